"""Settings of the test application: its database from the environment (the cloud straight,
or the LokaDB proxy in front of it); the application cannot tell which."""
import os

SECRET_KEY = "lokadb-test-application"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["notes"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": os.environ.get("LOKANOTES_HOST", "127.0.0.1"),
        "PORT": os.environ["LOKANOTES_PORT"],
        "NAME": os.environ.get("LOKANOTES_DB", "app"),
        "USER": os.environ.get("LOKANOTES_USER", "app"),
        "PASSWORD": os.environ["LOKANOTES_PASSWORD"],
        # The tests run in the application's own database (`test --keepdb`): it is the one
        # LokaDB routes, with organizations moved out of it. It is deployed by `manage.py
        # migrate` beforehand, to the migration the models are at (LOKANOTES_STATE): the test
        # runner must not migrate it further.
        "TEST": {"NAME": os.environ.get("LOKANOTES_DB", "app"), "MIGRATE": False},
    }
}

# The application's pages (notes/views.py), served by any WSGI server (lokanotes.wsgi): the
# Django benchmark (research/bench/django_app.py) drives them over HTTP.
ROOT_URLCONF = "lokanotes.urls"
ALLOWED_HOSTS = ["*"]
MIDDLEWARE = []
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True}]
# Served: a connection per worker thread kept across requests, as an application deploys it.
DATABASES["default"]["CONN_MAX_AGE"] = int(os.environ.get("LOKANOTES_CONN_MAX_AGE", "0")) or None
