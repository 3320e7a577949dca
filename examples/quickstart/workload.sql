-- A short scripted workload; each statement is its own transaction, with a
-- pause after it so that skein publishes each step as its own batch.
INSERT INTO customer (id, name, email, credit_limit) VALUES (1, 'Ada Lovelace', 'ada@example.com', 1000.00);
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
INSERT INTO customer (id, name, email, credit_limit) VALUES (2, 'Grace Hopper', 'grace@example.com', 2500.50);
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
INSERT INTO customer (id, name, email) VALUES (3, 'Edsger Dijkstra', NULL);
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
INSERT INTO address (id, customer_id, kind, city) VALUES (10, 1, 'home', 'London'), (20, 2, 'work', 'Arlington');
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
INSERT INTO address_line (address_id, line_no, text) VALUES (10, 1, '12 St James''s Square');
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
INSERT INTO contact (customer_id, kind, value) VALUES (1, 'phone', '+44 20 0000 0000');
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
-- update of a root
UPDATE customer SET credit_limit = 1500.00, row_version = row_version + 1 WHERE id = 1;
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
-- update of a child and of a grandchild
UPDATE address SET city = 'Washington' WHERE id = 20;
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
UPDATE address_line SET text = '12 St James''s Sq., Westminster' WHERE address_id = 10 AND line_no = 1;
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
-- a child moved to another customer: both customers change
UPDATE address SET customer_id = 3 WHERE id = 10;
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
-- logical delete
UPDATE customer SET is_deleted = true WHERE id = 2;
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
-- an update that changes nothing but the excluded row version: no event
UPDATE customer SET row_version = row_version + 1 WHERE id = 3;
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
-- physical delete
DELETE FROM contact WHERE customer_id = 1;
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
DELETE FROM customer WHERE id = 1;
DO $$ BEGIN PERFORM pg_sleep(0.3); END $$;  -- let each step be its own batch
