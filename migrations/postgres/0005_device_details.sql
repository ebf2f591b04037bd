-- What the agent reports beyond RFD 114's ids (names, links, slot, AER counters), as JSON.
-- Kept in step with migrations/sqlite.
ALTER TABLE devices ADD COLUMN details TEXT;
