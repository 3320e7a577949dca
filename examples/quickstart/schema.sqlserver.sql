-- The quickstart's source tables on SQL Server (schema dbo): the same
-- aggregate as schema.sql, with types whose event JSON matches PostgreSQL's
-- (see the README's value formats), so both sources give equal etags.
IF OBJECT_ID(N'dbo.contact') IS NOT NULL DROP TABLE dbo.contact;
IF OBJECT_ID(N'dbo.address_line') IS NOT NULL DROP TABLE dbo.address_line;
IF OBJECT_ID(N'dbo.address') IS NOT NULL DROP TABLE dbo.address;
IF OBJECT_ID(N'dbo.customer') IS NOT NULL DROP TABLE dbo.customer;

CREATE TABLE dbo.customer (
  id           int               NOT NULL PRIMARY KEY,
  name         nvarchar(200)     NOT NULL,
  email        nvarchar(200)     NULL,
  credit_limit decimal(12, 2)    NULL,
  is_deleted   bit               NOT NULL DEFAULT 0,
  row_version  int               NOT NULL DEFAULT 1,
  created_at   datetimeoffset(6) NOT NULL DEFAULT '2024-01-01T00:00:00Z'
);

CREATE TABLE dbo.address (
  id          int           NOT NULL PRIMARY KEY,
  customer_id int           NULL,     -- join column: captured by CDC
  kind        nvarchar(50)  NOT NULL,
  city        nvarchar(200) NOT NULL
);

CREATE TABLE dbo.address_line (
  address_id int           NOT NULL,
  line_no    int           NOT NULL,
  text       nvarchar(400) NOT NULL,
  PRIMARY KEY (address_id, line_no)
);

CREATE TABLE dbo.contact (
  customer_id int           NOT NULL,
  kind        nvarchar(50)  NOT NULL,
  value       nvarchar(400) NOT NULL,
  PRIMARY KEY (customer_id, kind)
);
