-- The job whose scrub moved a device to `cleaning`: a scrub step resumed after a restart
-- takes up its own devices still `cleaning` (the node may never have scrubbed them),
-- and no other job's. Kept as it was once the device leaves `cleaning`.
ALTER TABLE devices ADD COLUMN scrub_job TEXT;
-- Kept in step with the other migrations tree.
