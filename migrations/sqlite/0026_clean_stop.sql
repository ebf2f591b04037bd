-- A clean stop: what a job step found (how a stop ended: "guest shut down after 12 s"),
-- and each package's wait for its guests to shut down (NULL: the default, 60 s). Kept in
-- step with migrations/postgres.
ALTER TABLE job_steps ADD COLUMN detail TEXT;
ALTER TABLE packages ADD COLUMN stop_grace_s INTEGER;
