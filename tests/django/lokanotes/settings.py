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
