-- What each node reports besides its devices: online CPUs and memory (NULL until an
-- agent that reads them reports). Placement checks a VM's vCPUs and memory against
-- them. Kept in step with migrations/postgres.
ALTER TABLE servers ADD COLUMN cpus INTEGER;
ALTER TABLE servers ADD COLUMN memory_mib INTEGER;
