-- LokaDB schema in an organization's database, version 1 (written by move-org/move-back).
-- lokadb.info: whose database this is; lokadb.changes: move-back's change capture (the same
-- table as the cloud's); lokadb.move_marker: logical mode's marker, filled by the subscription.
CREATE SCHEMA IF NOT EXISTS lokadb;
CREATE TABLE IF NOT EXISTS lokadb.info (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    org       text NOT NULL,
    version   int NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS lokadb.changes (
    id   bigserial PRIMARY KEY,
    org  text NOT NULL,
    rel  text NOT NULL,
    key  text[] NOT NULL
);
CREATE INDEX IF NOT EXISTS changes_org ON lokadb.changes (org, id);
CREATE TABLE IF NOT EXISTS lokadb.move_marker (
    org   text PRIMARY KEY,
    token text NOT NULL
);
