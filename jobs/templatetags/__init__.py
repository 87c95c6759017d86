"""Template tags of the jobs app (``{% load omni %}``)."""
