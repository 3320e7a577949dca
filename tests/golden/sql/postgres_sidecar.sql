-- skein sidecar schema, version 9.
CREATE SCHEMA IF NOT EXISTS "skein";

CREATE TABLE IF NOT EXISTS "skein"."schema_version" (
  "version"    integer     PRIMARY KEY,
  "applied_at" timestamptz NOT NULL DEFAULT now()
);

-- The exactly-once recovery marker: the last source position (in-process) or
-- the next Kafka offset each partition consumes, plus the last source change
-- applied (re-sent records at or before it are dropped). Moves only inside the
-- batch transaction. Source positions are numbers that order like the source
-- (80 bits for a SQL Server LSN, hence numeric); source_commit is the display
-- form (0/16B3748 or 0x0000002A000001F00003).
CREATE TABLE IF NOT EXISTS "skein"."progress" (
  "group_name"    text        NOT NULL,
  "topic"         text        NOT NULL,
  "partition"     integer     NOT NULL,
  "position"      numeric(25,0) NOT NULL,
  "source_commit" text,
  "source_seq"    bigint,
  "epoch"         bigint      NOT NULL DEFAULT 0,
  "updated_at"    timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY ("group_name", "topic", "partition")
);
ALTER TABLE "skein"."progress" ADD COLUMN IF NOT EXISTS "source_commit" text;
ALTER TABLE "skein"."progress" ADD COLUMN IF NOT EXISTS "source_seq" bigint;
-- Version 4: the fencing epoch. Every ownership change (an applier taking
-- the partition) and every rewind (`skein replay`) adds one; a batch commits
-- only if both position and epoch are still what its applier read, so a
-- position written back by a rewind does not let a stale applier through.
ALTER TABLE "skein"."progress" ADD COLUMN IF NOT EXISTS "epoch" bigint NOT NULL DEFAULT 0;
-- Version 5: where a TRUNCATE re-check stands. A TRUNCATE re-checks every
-- aggregate of its entity the partition published, a page of keys per batch
-- transaction; while one is under way, source_* is the truncate notice and
-- this the last key re-checked (NULL otherwise).
ALTER TABLE "skein"."progress" ADD COLUMN IF NOT EXISTS "recheck_after" text;

-- Version 4: the partition count the extractor keys records by, per group
-- and topic. A different count re-keys aggregates between partitions, so
-- the extractor changes it only when no partition holds unapplied records.
CREATE TABLE IF NOT EXISTS "skein"."transport" (
  "group_name" text        NOT NULL,
  "topic"      text        NOT NULL,
  "partitions" integer     NOT NULL,
  "updated_at" timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY ("group_name", "topic")
);

-- Version 4: each relay's state and last error, for `skein status`.
CREATE TABLE IF NOT EXISTS "skein"."relay" (
  "name"       text        PRIMARY KEY,
  "state"      text        NOT NULL,
  "last_error" text,
  "error_at"   timestamptz,
  "updated_at" timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS "skein"."batch" (
  "id"             bigserial   PRIMARY KEY,
  "correlation_id" uuid        NOT NULL UNIQUE,
  "group_name"     text        NOT NULL,
  "topic"          text        NOT NULL,
  "partition"      integer     NOT NULL,
  "lower_position" numeric(25,0) NOT NULL,
  "upper_position" numeric(25,0) NOT NULL,
  "record_count"   integer     NOT NULL,
  "entity_count"   integer     NOT NULL,
  "event_count"    integer     NOT NULL,
  "has_data_loss"  boolean     NOT NULL DEFAULT false,
  "dead_letters"   integer     NOT NULL DEFAULT 0,
  "created_at"     timestamptz NOT NULL DEFAULT now()
);
-- Undecodable records sent to the dead-letter topic by this batch.
ALTER TABLE "skein"."batch" ADD COLUMN IF NOT EXISTS "dead_letters" integer NOT NULL DEFAULT 0;

-- Version 3: positions wide enough for SQL Server LSNs. A version 2 sidecar
-- held PostgreSQL LSNs in bigint; they keep their value and order.
DO $$
BEGIN
  IF (SELECT data_type FROM information_schema.columns WHERE table_schema = 'skein'
      AND table_name = 'progress' AND column_name = 'source_commit') = 'bigint' THEN
    ALTER TABLE "skein"."progress"
      ALTER COLUMN "position" TYPE numeric(25,0),
      ALTER COLUMN "source_commit" TYPE text
        USING upper(to_hex("source_commit" >> 32)) || '/' || upper(to_hex("source_commit" & 4294967295));
    ALTER TABLE "skein"."batch"
      ALTER COLUMN "lower_position" TYPE numeric(25,0),
      ALTER COLUMN "upper_position" TYPE numeric(25,0);
  END IF;
END $$;

CREATE TABLE IF NOT EXISTS "skein"."version" (
  "entity"     text        NOT NULL,
  "key"        text        NOT NULL,
  "etag"       text,
  "is_deleted" boolean     NOT NULL DEFAULT false,
  "updated_at" timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY ("entity", "key")
);

-- Version 7: the outbox's rows live in outbox_row; "outbox" is a view of
-- them with dequeued_at derived from the relay's cursors (below).
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'skein' AND c.relname = 'outbox' AND c.relkind = 'r') THEN
    ALTER TABLE "skein"."outbox" RENAME TO "outbox_row";
  END IF;
END $$;
CREATE TABLE IF NOT EXISTS "skein"."outbox_row" (
  "id"          bigserial   PRIMARY KEY,
  "event_id"    uuid        NOT NULL UNIQUE,
  "batch_id"    bigint      NOT NULL,
  "entity"      text        NOT NULL,
  "key"         text        NOT NULL,
  "partition"   integer     NOT NULL,
  "etag"        text,
  "event"       text        NOT NULL,
  "commit_time" timestamptz NOT NULL,
  "enqueued_at" timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS "outbox_entity_key" ON "skein"."outbox_row" ("entity", "key", "id");

-- Version 6: explicit runs (`skein explicit`, `extractor.initial_load`). A
-- run selects root keys of an entity and queues them a chunk per transaction,
-- with its cursor (the last key or index queued): a killed run resumes after
-- it. Each partition's applier takes its queued keys, publishes them in its
-- own fenced batch transaction and deletes them there: exactly once, and in
-- order with the stream of that partition.
CREATE TABLE IF NOT EXISTS "skein"."explicit_run" (
  "id"         bigserial   PRIMARY KEY,
  "group_name" text        NOT NULL,
  "entity"     text        NOT NULL,
  "selection"  text        NOT NULL,
  "republish"  boolean     NOT NULL DEFAULT false,
  "initial"    boolean     NOT NULL DEFAULT false,
  "state"      text        NOT NULL DEFAULT 'selecting',
  "cursor"     text,
  "queued"     bigint      NOT NULL DEFAULT 0,
  "created_at" timestamptz NOT NULL DEFAULT now(),
  "updated_at" timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS "skein"."explicit_queue" (
  "id"         bigserial   PRIMARY KEY,
  "run_id"     bigint      NOT NULL REFERENCES "skein"."explicit_run" ("id"),
  "group_name" text        NOT NULL,
  "topic"      text        NOT NULL,
  "partition"  integer     NOT NULL,
  "entity"     text        NOT NULL,
  "key"        text        NOT NULL,
  "republish"  boolean     NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS "explicit_queue_partition" ON "skein"."explicit_queue" ("group_name", "topic", "partition", "id");
CREATE INDEX IF NOT EXISTS "explicit_queue_run" ON "skein"."explicit_queue" ("run_id");

-- Version 7: the relay keeps one cursor per outbox partition, the last id
-- it sent, instead of rewriting every row it sends (versions 1 to 6 set
-- outbox.dequeued_at: a new row version and four index entries per event).
-- A partition's ids grow in commit order (its batch transactions take the
-- partition's outbox lock before they write), so every row above the
-- cursor is pending and none below it is. Relayed rows are deleted after
-- `sidecar.outbox_retention_secs`, a chunk at a time, by the relay.
CREATE TABLE IF NOT EXISTS "skein"."relay_cursor" (
  "partition"  integer     PRIMARY KEY,
  "last_id"    bigint      NOT NULL,
  "updated_at" timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS "outbox_partition_id" ON "skein"."outbox_row" ("partition", "id");
CREATE INDEX IF NOT EXISTS "outbox_enqueued" ON "skein"."outbox_row" ("enqueued_at");
-- From version 6: each partition's cursor stops below its first pending
-- row (a row relayed above it, out of order, is sent once more: at least
-- once, as after a crash), then dequeued_at goes.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'skein'
             AND table_name = 'outbox_row' AND column_name = 'dequeued_at') THEN
    INSERT INTO "skein"."relay_cursor" ("partition", "last_id")
      SELECT "partition", coalesce(min("id") FILTER (WHERE "dequeued_at" IS NULL) - 1, max("id"))
      FROM "skein"."outbox_row" GROUP BY "partition"
      ON CONFLICT DO NOTHING;
    DROP INDEX IF EXISTS "skein"."outbox_pending";
    DROP INDEX IF EXISTS "skein"."outbox_dequeued";
    ALTER TABLE "skein"."outbox_row" DROP COLUMN "dequeued_at";
  END IF;
END $$;
-- The outbox as versions 1 to 6 had it, for readers: dequeued_at is null
-- above the partition's cursor, and below it the time the cursor last
-- moved (at or after the row was sent). `WHERE dequeued_at IS NULL` reads
-- only the rows above the cursors, by index (`OFFSET 0` keeps the planner
-- from joining the whole table to the cursors).
CREATE OR REPLACE VIEW "skein"."outbox" AS
  SELECT o."id", o."event_id", o."batch_id", o."entity", o."key", o."partition", o."etag",
         o."event", o."commit_time", o."enqueued_at", NULL::timestamptz AS "dequeued_at"
  FROM "skein"."relay_cursor" c CROSS JOIN LATERAL
    (SELECT * FROM "skein"."outbox_row"
     WHERE ("partition", "id") > (c."partition", c."last_id")
       AND ("partition", "id") <= (c."partition", 9223372036854775807) OFFSET 0) o
  UNION ALL
  SELECT o."id", o."event_id", o."batch_id", o."entity", o."key", o."partition", o."etag",
         o."event", o."commit_time", o."enqueued_at", c."updated_at"
  FROM "skein"."relay_cursor" c JOIN "skein"."outbox_row" o
    ON o."partition" = c."partition" AND o."id" <= c."last_id";

-- Version 6: global identifiers (`identifier_mapping: true`), nTangle's
-- IdentifierMapping. Written in the batch transaction of an aggregate's
-- first event, then read back for every later one (replays and explicit
-- runs included): stable. A row inserted beforehand pre-assigns the id.
CREATE TABLE IF NOT EXISTS "skein"."identifier_mapping" (
  "entity"     text        NOT NULL,
  "key"        text        NOT NULL,
  "global_id"  text        NOT NULL,
  "created_at" timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY ("entity", "key"),
  UNIQUE ("entity", "global_id")
);

-- Version 8 changes no table: the relay locks the cursors it moves with
-- advisory locks instead of FOR UPDATE (it holds no transaction id while it
-- sends). A version-7 relay and a version-8 one do not exclude each other,
-- so every process of a pipeline is upgraded together; one of version 7
-- started after this migration refuses the sidecar.
-- Version 9: an outbox row's batch_id is no foreign key any more. A batch's
-- outbox rows are written in the transaction that inserts its batch row,
-- and batch rows are never deleted, so the key checked nothing; its check
-- ran once per event (a trigger and a key-share lock of the batch row), a
-- third of the outbox insert's cost.
ALTER TABLE "skein"."outbox_row" DROP CONSTRAINT IF EXISTS "outbox_row_batch_id_fkey";
ALTER TABLE "skein"."outbox_row" DROP CONSTRAINT IF EXISTS "outbox_batch_id_fkey";
INSERT INTO "skein"."schema_version" ("version") VALUES (9) ON CONFLICT DO NOTHING;
