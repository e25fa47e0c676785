\set id random(1, 200000)
SELECT id, organization_id, title, updated_at FROM documents WHERE id = :id;
