# change a column's type
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("notes", "0004_rename_priority_rank")]

    operations = [
        migrations.AlterField(model_name="note", name="rank", field=models.BigIntegerField(default=0)),
    ]
