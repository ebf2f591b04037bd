-- What a node's agent reports of the machine beyond its CPU and memory totals (address
-- width, NUMA nodes with their CPUs, memory and huge pages), as JSON; NULL until an agent
-- that reads them reports.
ALTER TABLE servers ADD COLUMN host_facts TEXT;
