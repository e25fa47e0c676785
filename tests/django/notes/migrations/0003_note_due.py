# add a nullable column
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("notes", "0002_note_priority")]

    operations = [
        migrations.AddField(model_name="note", name="due", field=models.DateTimeField(null=True)),
    ]
