-- hydrate customer (public.customer)
SELECT k.ord, '[]' AS link, json_build_object('id', t0."id"::text)::text AS refs, CASE WHEN t0."id" IS NULL THEN NULL ELSE (json_build_object('id', t0."id", 'name', (t0."name")::text, 'email', (t0."email")::text, 'credit_limit', (t0."credit_limit")::text, 'is_deleted', t0."is_deleted", 'row_version', t0."row_version", 'created_at', to_char((t0."created_at") AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')))::text END AS data, COALESCE((t0."is_deleted")::boolean, false) AS is_deleted
FROM unnest($1::text[]) WITH ORDINALITY AS k(v0, ord)
LEFT JOIN "public"."customer" t0 ON t0."id" = k.v0::integer
ORDER BY k.ord;

-- hydrate addresses (public.address)
SELECT k.ord, json_build_array(t1."customer_id"::text)::text AS link, json_build_object('id', t1."id"::text)::text AS refs, (json_build_object('id', t1."id", 'customer_id', t1."customer_id", 'kind', (t1."kind")::text, 'city', (t1."city")::text))::text AS data, false AS is_deleted
FROM unnest($1::text[]) WITH ORDINALITY AS k(v0, ord)
JOIN "public"."customer" t0 ON t0."id" = k.v0::integer
JOIN "public"."address" t1 ON t1."customer_id" = t0."id"
ORDER BY k.ord, t1."id";

-- hydrate lines (public.address_line)
SELECT k.ord, json_build_array(t2."address_id"::text)::text AS link, '{}' AS refs, (json_build_object('address_id', t2."address_id", 'line_no', t2."line_no", 'text', (t2."text")::text))::text AS data, false AS is_deleted
FROM unnest($1::text[]) WITH ORDINALITY AS k(v0, ord)
JOIN "public"."customer" t0 ON t0."id" = k.v0::integer
JOIN "public"."address" t1 ON t1."customer_id" = t0."id"
JOIN "public"."address_line" t2 ON t2."address_id" = t1."id"
ORDER BY k.ord, t2."address_id", t2."line_no";

-- hydrate contacts (public.contact)
SELECT k.ord, json_build_array(t1."customer_id"::text)::text AS link, '{}' AS refs, (json_build_object('customer_id', t1."customer_id", 'kind', (t1."kind")::text, 'value', (t1."value")::text))::text AS data, false AS is_deleted
FROM unnest($1::text[]) WITH ORDINALITY AS k(v0, ord)
JOIN "public"."customer" t0 ON t0."id" = k.v0::integer
JOIN "public"."contact" t1 ON t1."customer_id" = t0."id"
ORDER BY k.ord, t1."customer_id", t1."kind";

-- resolve roots of lines (grandchild)
SELECT k.ord, json_build_array(u1."id"::text)::text AS root_key
FROM unnest($1::text[]) WITH ORDINALITY AS k(v0, ord)
JOIN "public"."address" u0 ON u0."id" = k.v0::integer
JOIN "public"."customer" u1 ON u0."customer_id" = u1."id"
ORDER BY k.ord;

-- unchanged TOAST values of contact, by key
SELECT k.ord, json_build_array(t."customer_id"::text)::text AS vals
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS k(v0, v1, ord)
JOIN "public"."contact" t ON t."customer_id" = k.v0::integer AND t."kind" = k.v1::text
ORDER BY k.ord;

-- explicit: root keys, all, first page
SELECT t0."id"::text
FROM "public"."customer" AS t0
ORDER BY t0."id"
LIMIT $1;

-- explicit: root keys, all, after a key
SELECT t0."id"::text
FROM "public"."customer" AS t0
WHERE (t0."id") > ($1::text::integer)
ORDER BY t0."id"
LIMIT $2;

-- explicit: root keys, --where, after a key
SELECT t0."id"::text
FROM "public"."customer" AS t0
WHERE (region = 'EU') AND (t0."id") > ($1::text::integer)
ORDER BY t0."id"
LIMIT $2;

-- explicit: given keys as the source prints them
SELECT k.v0::integer::text FROM unnest($1::text[]) WITH ORDINALITY AS k(v0, ord) ORDER BY k.ord;
