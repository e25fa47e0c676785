# drop an index
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("notes", "0007_note_rank_idx")]

    operations = [
        migrations.RemoveIndex(model_name="note", name="notes_rank_idx"),
    ]
