"""The test application's own tests. tests/tests/it/django.rs runs them straight at the cloud
and through the LokaDB proxy; they must pass both ways. Organization 1 stays in the cloud, 2
is moved with the direct path (fdw+direct), 3 through postgres_fdw only (fdw); each has
SEEDED notes whose body starts with "seed". Each test writes rows marked with its own prefix
and deletes them after (the tests share the application's database: TestCase's transaction
around every test would keep every statement on the cloud, which is not how the application
runs)."""
import uuid

from django.db import IntegrityError, transaction
from django.db.models import Count, F
from django.test import Client, SimpleTestCase

from .models import STATE, Audit, Note, Organization, Tag

CLOUD, DIRECT, FDW = 1, 2, 3
ORGS = (CLOUD, DIRECT, FDW)
SEEDED = 20


class NotesTest(SimpleTestCase):
    databases = {"default"}

    def setUp(self):
        self.mark = f"t-{uuid.uuid4().hex[:12]}"

    def tearDown(self):
        Note.objects.filter(body__startswith=self.mark).delete()
        Audit.objects.filter(action__startswith=self.mark).delete()
        Tag.objects.filter(label__startswith=self.mark).delete()

    def note(self, org, suffix="", **fields):
        return Note.objects.create(organization_id=org, body=f"{self.mark}{suffix}", **fields)

    def test_reads_by_organization(self):
        for org in ORGS:
            seeded = Note.objects.filter(organization_id=org, body__startswith="seed")
            self.assertEqual(seeded.count(), SEEDED, org)
            first = seeded.order_by("id").first()
            self.assertEqual((first.organization_id, first.body), (org, f"seed {org} 1"))
            self.assertEqual(Note.objects.get(pk=first.pk).body, first.body)

    def test_update_then_create_in_one_atomic_block(self):
        for org in ORGS:
            a = self.note(org, "-a")
            with transaction.atomic():
                self.assertEqual(Note.objects.filter(organization_id=org, id=a.id).update(n=F("n") + 1), 1)
                self.note(org, "-audit")
            a.refresh_from_db()
            self.assertEqual(a.n, 1, org)
            self.assertEqual(Note.objects.filter(organization_id=org, body__startswith=self.mark).count(), 2)

    def test_a_rolled_back_block_leaves_nothing(self):
        for org in ORGS:
            a = self.note(org, "-a")
            with self.assertRaises(RuntimeError):
                with transaction.atomic():
                    Note.objects.filter(organization_id=org, id=a.id).update(n=7)
                    self.note(org, "-gone")
                    raise RuntimeError("roll back")
            a.refresh_from_db()
            self.assertEqual(a.n, 0, org)
            self.assertFalse(Note.objects.filter(body=f"{self.mark}-gone").exists())

    def test_select_for_update(self):
        for org in ORGS:
            a = self.note(org)
            with transaction.atomic():
                locked = Note.objects.select_for_update().get(organization_id=org, id=a.id)
                locked.n += 5
                locked.save()
            a.refresh_from_db()
            self.assertEqual(a.n, 5, org)

    def test_bulk_create_returns_every_id(self):
        for org in ORGS:
            made = Note.objects.bulk_create([Note(organization_id=org, body=f"{self.mark}-{i}") for i in range(25)])
            ids = [m.id for m in made]
            self.assertTrue(all(ids), org)
            self.assertEqual(len(set(ids)), 25)
            self.assertEqual(Note.objects.filter(id__in=ids, organization_id=org).count(), 25)

    def test_update_or_create(self):
        for org in ORGS:
            obj, created = Note.objects.update_or_create(organization_id=org, body=f"{self.mark}-u", defaults={"n": 1})
            self.assertTrue(created)
            again, created = Note.objects.update_or_create(organization_id=org, body=f"{self.mark}-u", defaults={"n": 2})
            self.assertFalse(created)
            self.assertEqual((again.id, Note.objects.get(id=obj.id).n), (obj.id, 2))

    def test_a_nested_block_recovers_from_an_error(self):
        for org in ORGS:
            with transaction.atomic():
                kept = self.note(org, "-kept")
                with self.assertRaises(IntegrityError):
                    with transaction.atomic():
                        Note.objects.create(organization_id=org, body=None)
                Note.objects.filter(id=kept.id, organization_id=org).update(n=3)
            self.assertEqual(Note.objects.get(id=kept.id).n, 3, org)

    def test_a_feed_with_select_related(self):
        tag = Tag.objects.create(label=self.mark)
        for org in ORGS:
            for i in range(3):
                self.note(org, f"-{i}", tag=tag)
            feed = list(
                Note.objects.filter(organization_id=org, body__startswith=self.mark)
                .select_related("organization", "tag")
                .order_by("-id")[:2]
            )
            self.assertEqual([n.body for n in feed], [f"{self.mark}-2", f"{self.mark}-1"])
            self.assertEqual(feed[0].organization.name, f"organization {org}")
            self.assertEqual(feed[0].tag.label, self.mark)

    def test_counts_across_organizations(self):
        counts = list(
            Note.objects.filter(body__startswith="seed")
            .values("organization_id")
            .annotate(c=Count("id"))
            .order_by("organization_id")
        )
        self.assertEqual(counts, [{"organization_id": o, "c": SEEDED} for o in ORGS])

    def test_a_cloud_table_in_the_same_transaction(self):
        for org in ORGS:
            a = self.note(org)
            with transaction.atomic():
                Note.objects.filter(organization_id=org, id=a.id).update(n=9)
                Audit.objects.create(organization_id=org, action=f"{self.mark}-{org}")
                self.assertEqual(Organization.objects.get(id=org).name, f"organization {org}")
            self.assertTrue(Audit.objects.filter(action=f"{self.mark}-{org}").exists())
            self.assertEqual(Note.objects.get(id=a.id).n, 9)

    def test_a_missing_organization_fails_at_commit(self):
        with self.assertRaises(IntegrityError):
            with transaction.atomic():
                Note.objects.create(organization_id=999, body=self.mark)
        self.assertFalse(Note.objects.filter(body=self.mark).exists())

    def test_foreign_keys_are_checked_at_commit(self):
        # Django's foreign keys are DEFERRABLE INITIALLY DEFERRED: a row may reference one
        # made later in the same transaction; a reference still missing fails at COMMIT.
        for org in ORGS:
            with transaction.atomic():
                early = self.note(org, "-early", tag_id=10_000_000 + org)
                Tag.objects.create(id=10_000_000 + org, label=f"{self.mark}-{org}")
            self.assertEqual(Note.objects.get(id=early.id).tag.label, f"{self.mark}-{org}")
            with self.assertRaises(IntegrityError):
                with transaction.atomic():
                    self.note(org, "-dangling", tag_id=20_000_000 + org)
            self.assertFalse(Note.objects.filter(body=f"{self.mark}-dangling").exists(), org)

    def test_delete(self):
        for org in ORGS:
            a = self.note(org)
            self.assertEqual(Note.objects.filter(organization_id=org, id=a.id).delete()[0], 1)
            self.assertFalse(Note.objects.filter(id=a.id).exists())

    def test_the_fields_of_this_migration(self):
        for org in ORGS:
            fields = {}
            if 2 <= STATE < 4:
                fields["priority"] = 4
            if STATE >= 4:
                fields["rank"] = 2**40 if STATE >= 5 else 6
            a = self.note(org, **fields)
            got = Note.objects.get(organization_id=org, id=a.id)
            for k, v in fields.items():
                self.assertEqual(getattr(got, k), v, (org, k))
            if 3 <= STATE < 9:
                self.assertIsNone(got.due)
        if STATE >= 6:
            tag = Tag.objects.create(label=self.mark)
            Audit.objects.create(organization_id=CLOUD, action=self.mark, tag=tag)
            with self.assertRaises(IntegrityError), transaction.atomic():
                Audit.objects.create(organization_id=CLOUD, action=self.mark)

    def test_pages(self):
        """The pages research/bench/django_app.py drives: a form creates a note (and its audit
        row in the cloud, in one transaction), the list, the note and the feed show it, a form
        updates it."""
        client = Client()
        for org in ORGS:
            r = client.post(f"/o/{org}/notes/new", {"body": f"{self.mark}-page", "n": "1"})
            self.assertEqual(r.status_code, 201, r.content)
            pk = int(r.content.split()[-1])
            try:
                self.assertEqual(Note.objects.get(pk=pk).organization_id, org)
                self.assertTrue(Audit.objects.filter(organization_id=org, action=f"create {pk}").exists())
                self.assertContains(client.get(f"/o/{org}/notes/"), f"{self.mark}-page")
                self.assertContains(client.get(f"/o/{org}/notes/{pk}/"), f"{self.mark}-page")
                self.assertContains(client.get(f"/o/{org}/feed/"), f"organization {org}: {self.mark}-page")
                r = client.post(f"/o/{org}/notes/{pk}/edit", {"body": f"{self.mark}-edited", "n": "3"})
                self.assertEqual(r.status_code, 200, r.content)
                self.assertEqual(Note.objects.get(pk=pk).n, 3)
                # Another organization's note is not found under this one.
                other = ORGS[(ORGS.index(org) + 1) % len(ORGS)]
                self.assertEqual(client.get(f"/o/{other}/notes/{pk}/").status_code, 404)
            finally:
                Audit.objects.filter(action=f"create {pk}").delete()
