"""The application as a WSGI callable (`gunicorn lokanotes.wsgi`)."""
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lokanotes.settings")
application = get_wsgi_application()
