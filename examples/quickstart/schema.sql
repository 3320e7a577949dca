-- The quickstart's source tables: a customer with addresses (each with
-- address lines: three levels) and contacts.
DROP TABLE IF EXISTS customer, address, address_line, contact;

CREATE TABLE customer (
  id           integer PRIMARY KEY,
  name         text        NOT NULL,
  email        text,
  credit_limit numeric(12, 2),
  is_deleted   boolean     NOT NULL DEFAULT false,
  row_version  integer     NOT NULL DEFAULT 1,
  created_at   timestamptz NOT NULL DEFAULT '2024-01-01T00:00:00Z'
);

CREATE TABLE address (
  id          integer PRIMARY KEY,
  customer_id integer,          -- join column, not in the key: REPLICA IDENTITY FULL
  kind        text NOT NULL,
  city        text NOT NULL
);

-- Hydration reads an aggregate's addresses by customer_id (`skein
-- validate` notes a join no index serves).
CREATE INDEX address_customer_id ON address (customer_id);

CREATE TABLE address_line (
  address_id integer NOT NULL,
  line_no    integer NOT NULL,
  text       text    NOT NULL,
  PRIMARY KEY (address_id, line_no)
);

CREATE TABLE contact (
  customer_id integer NOT NULL,
  kind        text    NOT NULL,
  value       text    NOT NULL,
  PRIMARY KEY (customer_id, kind)   -- join column in the key: default identity suffices
);
