from django.apps import AppConfig


class ChaosAppConfig(AppConfig):
    """Installed so that `manage.py chaos` is found; the package has no models."""

    name = "chaos"
    verbose_name = "Chaos soak"
