-- vGPU variants that may share a GPU with other such variants of the same parent (MIG-backed
-- types, or time-sliced types in mixed-size mode): 1 = yes. Kept in step with
-- migrations/postgres.
ALTER TABLE variants ADD COLUMN mix INTEGER NOT NULL DEFAULT 0;
