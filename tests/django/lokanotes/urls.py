"""The application's pages."""
from django.urls import path

from notes import views

urlpatterns = [
    path("o/<int:org>/notes/", views.note_list),
    path("o/<int:org>/notes/new", views.note_create),
    path("o/<int:org>/notes/<int:pk>/", views.note_detail),
    path("o/<int:org>/notes/<int:pk>/edit", views.note_update),
    path("o/<int:org>/feed/", views.feed),
]
