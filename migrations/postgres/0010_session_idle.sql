-- Login sessions end after a time without use (the idle timeout) as well as at their
-- expiry (the absolute timeout): when each token was last used. Kept in step with
-- migrations/sqlite.
ALTER TABLE tokens ADD COLUMN last_used_at BIGINT NOT NULL DEFAULT 0;
UPDATE tokens SET last_used_at = created_at;
