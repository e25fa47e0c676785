-- Version 18: `lokadb enable`'s key map backfill resumes after the last key a killed run
-- copied, instead of from the first key. Each batch records its last key in the same
-- statement that copies it, so what is recorded was copied. Resuming there is safe: the key
-- map's row trigger has kept every write since the swap, so a key below it that was not
-- copied was written (and mapped) after the batch that passed it.
ALTER TABLE lokadb.keys ADD COLUMN backfill_last text[];
COMMENT ON COLUMN lokadb.keys.backfill_last IS
    'the last key (each column as text) the backfill copied, while it is not done';
