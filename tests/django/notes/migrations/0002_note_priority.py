# add a column with a default
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("notes", "0001_initial")]

    operations = [
        migrations.AddField(model_name="note", name="priority", field=models.IntegerField(default=0)),
    ]
