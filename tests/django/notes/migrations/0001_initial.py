import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Organization",
            fields=[
                ("id", models.BigIntegerField(primary_key=True, serialize=False)),
                ("name", models.TextField()),
            ],
            options={"db_table": "organizations"},
        ),
        migrations.CreateModel(
            name="Tag",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("label", models.TextField(unique=True)),
            ],
            options={"db_table": "tags"},
        ),
        migrations.CreateModel(
            name="Note",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("body", models.TextField()),
                ("n", models.IntegerField(default=0)),
                ("organization", models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, to="notes.organization")),
                ("tag", models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, to="notes.tag")),
            ],
            options={"db_table": "notes"},
        ),
        migrations.CreateModel(
            name="Audit",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("action", models.TextField()),
                ("at", models.DateTimeField(auto_now_add=True)),
                ("organization", models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, to="notes.organization")),
            ],
            options={"db_table": "audit"},
        ),
    ]
