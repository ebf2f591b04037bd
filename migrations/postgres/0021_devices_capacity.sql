-- The capacity view counts devices by variant, state and taint: with taint and the
-- server in the index, that is a walk of the index alone, in group order, instead of a
-- read of every device's row (its details included). The placement reads use the same
-- first columns as before.
DROP INDEX devices_placement;
CREATE INDEX devices_placement ON devices (variant, state, missing, taint, server_uuid);
-- The reconciler's periodic looks for forgotten dirty devices and for shared functions
-- read only those: at 10,000 GPUs each was a scan of every function (20-25 ms, every
-- pass). Few rows are in either state, so the indexes cost little to keep.
CREATE INDEX devices_dirty ON devices (updated_at) WHERE state = 'dirty';
CREATE INDEX devices_shared ON devices (server_uuid, id) WHERE state = 'shared';
-- Kept in step with the other migrations tree.
