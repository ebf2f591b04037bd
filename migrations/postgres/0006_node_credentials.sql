-- A join token may re-admit a known server (after its credential was revoked or lost):
-- the node keeps its identity and gets a new credential. Kept in step with
-- migrations/sqlite.
ALTER TABLE join_tokens ADD COLUMN for_server TEXT;
