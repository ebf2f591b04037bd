-- Job leases: the replica running a job holds a lease it renews; a job whose lease ran
-- out (its replica died) is taken over by another. Kept in step with migrations/postgres.
ALTER TABLE jobs ADD COLUMN lease_owner TEXT;
ALTER TABLE jobs ADD COLUMN lease_until INTEGER;
CREATE INDEX jobs_unfinished ON jobs (state, lease_until);
