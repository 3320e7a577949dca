-- migrate
BEGIN;
SET LOCAL client_min_messages TO warning;
SELECT pg_advisory_xact_lock(hashtext('skein.sidecar.migrate'));
-- (the DDL of postgres_sidecar.sql)
COMMIT;;

-- progress of a partition
SELECT position::text, source_commit, source_seq, epoch, recheck_after FROM "skein"."progress" WHERE group_name = $1 AND topic = $2 AND partition = $3;

-- an applier takes a partition
UPDATE "skein"."progress" SET epoch = epoch + 1 WHERE group_name = $1 AND topic = $2 AND partition = $3 RETURNING position::text, source_commit, source_seq, epoch, recheck_after;

-- progress of every partition
SELECT partition, position::text, source_commit, source_seq, epoch, recheck_after FROM "skein"."progress" WHERE group_name = $1 AND topic = $2 ORDER BY partition;

-- forget partitions' progress (re-keying)
DELETE FROM "skein"."progress" WHERE group_name = $1 AND topic = $2 AND partition = ANY($3);

-- partition count of a topic
SELECT partitions FROM "skein"."transport" WHERE group_name = $1 AND topic = $2;

-- record the partition count
INSERT INTO "skein"."transport" (group_name, topic, partitions) VALUES ($1, $2, $3) ON CONFLICT (group_name, topic) DO UPDATE SET partitions = EXCLUDED.partitions, updated_at = now();

-- batch transaction 1a: fence
UPDATE "skein"."progress" SET position = $4::text::numeric, source_commit = $6, source_seq = $7, recheck_after = $9, updated_at = now() WHERE group_name = $1 AND topic = $2 AND partition = $3 AND position = $5::text::numeric AND epoch = $8;

-- batch transaction 1b: first progress
INSERT INTO "skein"."progress" (group_name, topic, partition, position, source_commit, source_seq, recheck_after) VALUES ($1, $2, $3, $4::text::numeric, $5, $6, $7) ON CONFLICT DO NOTHING;

-- batch transaction, fenced: the position found
SELECT position::text, epoch FROM "skein"."progress" WHERE group_name = $1 AND topic = $2 AND partition = $3;

-- batch transaction 2: batch row
INSERT INTO "skein"."batch" (correlation_id, group_name, topic, partition, lower_position, upper_position, record_count, entity_count, event_count, has_data_loss, dead_letters) VALUES ($1::text::uuid, $2, $3, $4, $5::text::numeric, $6::text::numeric, $7, $8, $9, $10, $11) RETURNING id;

-- batch transaction 3a: the partition's outbox lock ($1 = 'skein.outbox.skein')
SELECT pg_advisory_xact_lock(hashtext($1), $2);

-- batch transaction 3a: the partition's relay cursor
INSERT INTO "skein"."relay_cursor" (partition, last_id) SELECT $1, 0 WHERE NOT EXISTS (SELECT 1 FROM "skein"."relay_cursor" WHERE partition = $1);

-- batch transaction 3: outbox rows
WITH i AS (INSERT INTO "skein"."outbox_row" (event_id, batch_id, entity, key, partition, etag, event, commit_time) SELECT u.id::uuid, $1, u.entity, u.key, $2, u.etag, u.event, 'epoch'::timestamptz + u.t * interval '1 microsecond' FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::int8[]) WITH ORDINALITY AS u(id, entity, key, etag, event, t, ord) ORDER BY u.ord RETURNING id) SELECT min(id) FROM i;

-- batch transaction 4: versions
INSERT INTO "skein"."version" (entity, key, etag, is_deleted) SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bool[]) ON CONFLICT (entity, key) DO UPDATE SET etag = EXCLUDED.etag, is_deleted = EXCLUDED.is_deleted, updated_at = now();

-- versions of some keys
SELECT v.key, v.etag, v.is_deleted FROM unnest($2::text[]) AS k(key) CROSS JOIN LATERAL (SELECT key, etag, is_deleted FROM "skein"."version" WHERE entity = $1 AND key = k.key OFFSET 0) v;

-- truncate: the keys to re-check
SELECT key FROM "skein"."version" WHERE entity = $1 AND NOT is_deleted AND ($2::text IS NULL OR key > $2) ORDER BY key LIMIT $3;

-- the newest schema version applied
SELECT max(version) FROM "skein"."schema_version";

-- pending outbox
SELECT count(*), coalesce(extract(epoch FROM now() - min(o.enqueued_at)) * 1000, 0)::int8 FROM "skein"."relay_cursor" c CROSS JOIN LATERAL (SELECT enqueued_at FROM "skein"."outbox_row" WHERE (partition, id) > (c.partition, c.last_id) AND (partition, id) <= (c.partition, 9223372036854775807) OFFSET 0) o;

-- relay: lock the cursors with rows above them, all partitions ($1 null) or owned ones ($2 = 'skein.outbox.skein')
SELECT p.partition, pg_advisory_xact_lock(hashtext($2), -1 - p.partition)::text FROM (SELECT partition FROM (SELECT partition, last_id FROM (SELECT c.partition, c.last_id, (SELECT id FROM "skein"."outbox_row" WHERE (partition, id) > (c.partition, c.last_id) AND (partition, id) <= (c.partition, 9223372036854775807) ORDER BY partition, id LIMIT 1) AS first FROM "skein"."relay_cursor" c WHERE ($1::int4[] IS NULL OR c.partition = ANY($1)) OFFSET 0) f WHERE f.first IS NOT NULL ORDER BY f.first LIMIT 64) a ORDER BY partition OFFSET 0) p;

-- relay: the rows above the cursors the round takes ($1 as above; $2 rows)
SELECT o.partition, o.id, o.entity, o.event FROM (SELECT partition, last_id FROM (SELECT c.partition, c.last_id, (SELECT id FROM "skein"."outbox_row" WHERE (partition, id) > (c.partition, c.last_id) AND (partition, id) <= (c.partition, 9223372036854775807) ORDER BY partition, id LIMIT 1) AS first FROM "skein"."relay_cursor" c WHERE ($1::int4[] IS NULL OR c.partition = ANY($1)) OFFSET 0) f WHERE f.first IS NOT NULL ORDER BY f.first LIMIT 64) c CROSS JOIN LATERAL (SELECT partition, id, entity, event FROM "skein"."outbox_row" WHERE (partition, id) > (c.partition, c.last_id) AND (partition, id) <= (c.partition, 9223372036854775807) ORDER BY partition, id LIMIT $2) o ORDER BY o.id LIMIT $2;

-- relay: move the cursors
UPDATE "skein"."relay_cursor" c SET last_id = u.last_id, updated_at = now() FROM unnest($1::int4[], $2::int8[]) AS u(partition, last_id) WHERE c.partition = u.partition;

-- relay lease, all partitions ($1 = 'skein.relay.skein')
SELECT pg_try_advisory_lock(hashtext($1));

-- relay lease, owned partitions
SELECT pg_try_advisory_lock_shared(hashtext($1));

-- relay lease holders
SELECT count(*) FILTER (WHERE mode = 'ExclusiveLock'), count(*) FILTER (WHERE mode = 'ShareLock') FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) AND ((classid::int8 << 32) | objid::int8) = hashtext($1)::int8;

-- relay: report its state
INSERT INTO "skein"."relay" (name, state, last_error, error_at) VALUES ($1, $2, $3, CASE WHEN $3::text IS NULL THEN NULL ELSE now() END) ON CONFLICT (name) DO UPDATE SET state = EXCLUDED.state, last_error = coalesce(EXCLUDED.last_error, "skein"."relay".last_error), error_at = coalesce(EXCLUDED.error_at, "skein"."relay".error_at), updated_at = now();

-- status: relay states
SELECT name, state, last_error, to_char(error_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'), to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"') FROM "skein"."relay" ORDER BY name;

-- replay: rewind a partition
UPDATE "skein"."progress" SET position = $5::int8, source_commit = NULL, source_seq = NULL, recheck_after = NULL, epoch = epoch + 1, updated_at = now() WHERE group_name = $1 AND topic = $2 AND partition = $3 AND position = $4::int8;

-- replay --republish: forget versions
DELETE FROM "skein"."version" WHERE entity = $1 AND key = ANY($2);

-- explicit: the unfinished run to resume
SELECT id, "cursor", queued FROM "skein"."explicit_run" WHERE group_name = $1 AND entity = $2 AND selection = $3 AND republish = $4 AND initial = $5 AND state = 'selecting' ORDER BY id LIMIT 1;

-- explicit: a new run
INSERT INTO "skein"."explicit_run" (group_name, entity, selection, republish, initial) VALUES ($1, $2, $3, $4, $5) RETURNING id;

-- explicit chunk 1: move the cursor
UPDATE "skein"."explicit_run" SET "cursor" = $3, queued = queued + $4, state = $5, updated_at = now() WHERE id = $1 AND "cursor" IS NOT DISTINCT FROM $2 AND state = 'selecting';

-- explicit chunk 2: queue keys
INSERT INTO "skein"."explicit_queue" (run_id, group_name, topic, partition, entity, key, republish) SELECT $1, $2, $3, u.p, $4, u.k, $5 FROM unnest($6::int4[], $7::text[]) WITH ORDINALITY AS u(p, k, ord) ORDER BY u.ord;

-- explicit: a partition's queued keys
SELECT id, entity, key, republish FROM "skein"."explicit_queue" WHERE group_name = $1 AND topic = $2 AND (partition = $3 OR (partition >= $5 AND partition % $5 = $3)) ORDER BY id LIMIT $4;

-- batch transaction 1c: explicit keys before the first progress, lock
INSERT INTO "skein"."progress" (group_name, topic, partition, position) VALUES ($1, $2, $3, 0) ON CONFLICT DO NOTHING;

-- batch transaction 1c: explicit keys before the first progress, unlock
DELETE FROM "skein"."progress" WHERE group_name = $1 AND topic = $2 AND partition = $3;

-- batch transaction 6: explicit keys off the queue
DELETE FROM "skein"."explicit_queue" WHERE id = ANY($1);

-- status: explicit runs
SELECT r.id, r.entity, r.selection, r.republish, r.initial, r.state, r."cursor", r.queued, (SELECT count(*) FROM "skein"."explicit_queue" q WHERE q.run_id = r.id), to_char(r.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'), to_char(r.updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"') FROM "skein"."explicit_run" r WHERE r.group_name = $1 AND (r.state = 'selecting' OR EXISTS (SELECT 1 FROM "skein"."explicit_queue" q WHERE q.run_id = r.id) OR r.id IN (SELECT id FROM "skein"."explicit_run" WHERE group_name = $1 ORDER BY id DESC LIMIT $2)) ORDER BY r.id DESC;

-- explicit: one run
SELECT r.id, r.entity, r.selection, r.republish, r.initial, r.state, r."cursor", r.queued, (SELECT count(*) FROM "skein"."explicit_queue" q WHERE q.run_id = r.id), to_char(r.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'), to_char(r.updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"') FROM "skein"."explicit_run" r WHERE r.id = $1;

-- global identifiers of some keys
SELECT m.key, m.global_id FROM unnest($2::text[]) AS k(key) CROSS JOIN LATERAL (SELECT key, global_id FROM "skein"."identifier_mapping" WHERE entity = $1 AND key = k.key OFFSET 0) m;

-- relay: purge relayed rows past their retention
DELETE FROM "skein"."outbox_row" WHERE id IN (SELECT o.id FROM "skein"."outbox_row" o JOIN "skein"."relay_cursor" c ON c.partition = o.partition AND o.id <= c.last_id WHERE o.enqueued_at < now() - $1 * interval '1 second' LIMIT $2 FOR UPDATE OF o SKIP LOCKED);

-- new global identifiers, before the batch transaction
INSERT INTO "skein"."identifier_mapping" (entity, key, global_id) SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) ORDER BY 1, 2 ON CONFLICT DO NOTHING;

-- keys holding global identifiers
SELECT global_id, key FROM "skein"."identifier_mapping" WHERE entity = $1 AND global_id = ANY($2);

-- start-up: identifiers of an entity-name namespace at odds with its table's
SELECT o.key, o.global_id, n.key, n.global_id FROM "skein"."identifier_mapping" o JOIN "skein"."identifier_mapping" n ON n.entity = $2 AND n.key = o.key WHERE o.entity = $1 AND n.global_id <> o.global_id UNION ALL SELECT o.key, o.global_id, n.key, n.global_id FROM "skein"."identifier_mapping" o JOIN "skein"."identifier_mapping" n ON n.entity = $2 AND n.global_id = o.global_id WHERE o.entity = $1 AND n.key <> o.key;

-- start-up: identifiers moved to the table's namespace, 1 of 2
DELETE FROM "skein"."identifier_mapping" WHERE entity = $2 AND key IN (SELECT key FROM "skein"."identifier_mapping" WHERE entity = $1);

-- start-up: identifiers moved to the table's namespace, 2 of 2
UPDATE "skein"."identifier_mapping" SET entity = $2 WHERE entity = $1;
