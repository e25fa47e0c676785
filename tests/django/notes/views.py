"""The application's pages: an organization's notes as a list, one note, a feed with its
organization and tag (`select_related`, newest first, sliced), and forms that create a note
(with an audit row in the cloud, in one transaction) and update one (`select_for_update`)."""
from django import forms
from django.db import DatabaseError, transaction
from django.http import HttpResponse, HttpResponseBadRequest
from django.shortcuts import get_object_or_404, render

from .models import Audit, Note


class NoteForm(forms.ModelForm):
    class Meta:
        model = Note
        fields = ["body", "tag", "n"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A note may have no tag (the column is nullable).
        self.fields["tag"].required = False


def note_list(request, org):
    notes = Note.objects.filter(organization_id=org).order_by("-id")[:50]
    return render(request, "notes/list.html", {"org": org, "notes": notes})


def note_detail(request, org, pk):
    note = get_object_or_404(Note.objects.select_related("tag"), organization_id=org, pk=pk)
    return render(request, "notes/detail.html", {"org": org, "note": note})


def feed(request, org):
    notes = (
        Note.objects.filter(organization_id=org)
        .select_related("organization", "tag")
        .order_by("-id")[:20]
    )
    return render(request, "notes/feed.html", {"org": org, "notes": notes})


def database_error(e):
    """A write the database refused (a serialization failure, a deadlock): 503 with its
    SQLSTATE, which a client may retry."""
    code = getattr(getattr(e, "__cause__", None), "sqlstate", None)
    return HttpResponse(f"database error {code}: {str(e).splitlines()[0][:200]}", status=503)


def note_create(request, org):
    form = NoteForm(request.POST)
    if request.method != "POST" or not form.is_valid():
        return HttpResponseBadRequest(str(form.errors))
    try:
        with transaction.atomic():
            note = form.save(commit=False)
            note.organization_id = org
            note.save()
            Audit.objects.create(organization_id=org, action=f"create {note.pk}")
    except DatabaseError as e:
        return database_error(e)
    return HttpResponse(f"created {note.pk}", status=201)


def note_update(request, org, pk):
    if request.method != "POST":
        return HttpResponseBadRequest("POST the note's fields")
    try:
        with transaction.atomic():
            note = get_object_or_404(Note.objects.select_for_update(), organization_id=org, pk=pk)
            form = NoteForm(request.POST, instance=note)
            if not form.is_valid():
                return HttpResponseBadRequest(str(form.errors))
            form.save()
    except DatabaseError as e:
        return database_error(e)
    return HttpResponse(f"updated {pk}")
