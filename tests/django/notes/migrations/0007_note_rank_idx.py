# add an index
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("notes", "0006_audit_tag_unique")]

    operations = [
        migrations.AddIndex(model_name="note", index=models.Index(fields=["rank"], name="notes_rank_idx")),
    ]
