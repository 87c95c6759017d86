"""Template tags of the pages: how a job is named on a page, so no link leads to a 403."""

from __future__ import annotations

from django import template
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from jobs import roles

register = template.Library()


@register.simple_tag(takes_context=True)
def job_link(context, job) -> SafeString:
    """The job's name, a link to its page only when the viewer may open it (``roles.job_visibility``)."""
    visibility = roles.job_visibility(context["request"].user, job)
    if visibility is roles.Visibility.FULL:
        return format_html('<a href="{}"><strong>{}</strong></a>', reverse("job-page", args=[job.pk]), job.name)
    if visibility is roles.Visibility.SUMMARY:
        return format_html('<strong title="{}">{}</strong>', "details are visible to its owner", job.name)
    return format_html("<strong>{}</strong>", roles.HIDDEN_JOB)
