# drop a column
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("notes", "0008_remove_rank_idx")]

    operations = [
        migrations.RemoveField(model_name="note", name="due"),
    ]
