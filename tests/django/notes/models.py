"""The test application's models. `LOKANOTES_STATE` (default: the last) is the migration the
database is at, so that each step of the migration history has its models (the history's
tests run the application's tests after each step)."""
import os

from django.db import models

STATE = int(os.environ.get("LOKANOTES_STATE", "9"))


class Organization(models.Model):
    """A cloud table: every organization's row stays in the cloud."""

    id = models.BigIntegerField(primary_key=True)
    name = models.TextField()

    class Meta:
        db_table = "organizations"


class Tag(models.Model):
    """A cloud table."""

    label = models.TextField(unique=True)

    class Meta:
        db_table = "tags"


class Note(models.Model):
    """The LokaDB table (`lokadb enable notes`): each organization's notes live where it is."""

    organization = models.ForeignKey(Organization, models.PROTECT)
    tag = models.ForeignKey(Tag, models.SET_NULL, null=True)
    body = models.TextField()
    n = models.IntegerField(default=0)
    if 2 <= STATE < 4:
        priority = models.IntegerField(default=0)
    if STATE == 4:
        rank = models.IntegerField(default=0)
    if STATE >= 5:
        rank = models.BigIntegerField(default=0)
    if 3 <= STATE < 9:
        due = models.DateTimeField(null=True)

    class Meta:
        db_table = "notes"
        indexes = [models.Index(fields=["rank"], name="notes_rank_idx")] if 7 <= STATE < 8 else []


class Audit(models.Model):
    """A cloud table written in the same transactions as notes."""

    organization = models.ForeignKey(Organization, models.PROTECT)
    action = models.TextField()
    at = models.DateTimeField(auto_now_add=True)
    if STATE >= 6:
        tag = models.ForeignKey(Tag, models.SET_NULL, null=True)

    class Meta:
        db_table = "audit"
        constraints = (
            [models.UniqueConstraint(fields=["organization", "action"], name="audit_org_action_uniq")]
            if STATE >= 6
            else []
        )
