-- A package may choose its placement policy ('pack' or 'spread'); NULL = the server's
-- default. Kept in step with migrations/postgres.
ALTER TABLE packages ADD COLUMN placement TEXT;
