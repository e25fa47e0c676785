# a unique constraint and a foreign key (on a cloud table: Postgres refuses both on a
# partitioned table with foreign partitions, docs/migrations.md)
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("notes", "0005_rank_bigint")]

    operations = [
        migrations.AddField(
            model_name="audit",
            name="tag",
            field=models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, to="notes.tag"),
        ),
        migrations.AddConstraint(
            model_name="audit",
            constraint=models.UniqueConstraint(fields=("organization", "action"), name="audit_org_action_uniq"),
        ),
    ]
