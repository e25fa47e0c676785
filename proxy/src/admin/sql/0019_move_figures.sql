-- Version 19: a move in progress publishes its figures, so that `lokadb status --watch`
-- (from any machine that reaches the cloud) shows its phase, rows and bytes, rate, lag and
-- ETA. Written by the move about once a second, read by nobody on the proxy's path.
ALTER TABLE lokadb.moves ADD COLUMN figures jsonb;
COMMENT ON COLUMN lokadb.moves.figures IS
    'the move''s last figures: phase, rows, bytes, estimate, rate, eta_s, lag (lokadb status)';
