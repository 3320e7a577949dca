-- skein: PostgreSQL CDC enablement for pipeline 'quickstart'.
-- Needs wal_level = logical (ALTER SYSTEM SET wal_level = logical; then restart).
-- The publication carries only key and join columns: skein reads the
-- latest state of an aggregate from the tables themselves.

-- public.address: deletes must carry customer_id, id which the primary key does not hold.
ALTER TABLE "public"."address" REPLICA IDENTITY FULL;

DO $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = 'skein_quickstart') THEN
    CREATE PUBLICATION "skein_quickstart";
  END IF;
END
$$;
ALTER PUBLICATION "skein_quickstart" SET (publish = 'insert, update, delete, truncate');
ALTER PUBLICATION "skein_quickstart" SET TABLE
  "public"."customer" ("id"),
  "public"."address",
  "public"."address_line" ("address_id", "line_no"),
  "public"."contact" ("customer_id", "kind");

-- The replication slot is created by `skein run` / `skein extract` on first start;
-- to create it yourself:
-- SELECT pg_create_logical_replication_slot('skein_quickstart', 'pgoutput');
