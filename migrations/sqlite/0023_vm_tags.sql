-- A VM's tags, as a JSON object of string, number and boolean values (CloudAPI's
-- `tag.KEY`), filterable by key and value.
ALTER TABLE vms ADD COLUMN tags TEXT NOT NULL DEFAULT '{}';
