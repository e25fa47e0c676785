# rename a column
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("notes", "0003_note_due")]

    operations = [
        migrations.RenameField(model_name="note", old_name="priority", new_name="rank"),
    ]
