-- Version 20: `lokadb split ORG` gives an organization in the cloud partitions of its own
-- ahead of its move (the first move then has no split, and pauses its writes only at the
-- switch). Its journal row says direction 'split', so that a move, a fold or another split
-- of the organization knows one is in progress and `lokadb status` shows it.
ALTER TABLE lokadb.moves DROP CONSTRAINT moves_direction_check;
ALTER TABLE lokadb.moves ADD CONSTRAINT moves_direction_check
    CHECK (direction IN ('out', 'back', 'split'));
COMMENT ON COLUMN lokadb.moves.direction IS
    'out (move-org), back (move-back) or split (lokadb split: partitions of its own in the cloud, ahead of a move)';
