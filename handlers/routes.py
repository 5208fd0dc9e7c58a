"""Every route of the service, in one list."""
from typing import Any

import tornado.web

from handlers.card import CardWebhookHandler
from handlers.console import console_routes
from handlers.crypto import CryptoProcessorWebhookHandler
from handlers.ops import HealthHandler, MetricsHandler, ReadyHandler
from handlers.links import FiledLinkHandler
from handlers.orders import OrderHandler
from handlers.openapi import OpenApiHandler
from handlers.public import (
    DotRequirementsHandler, ReferralCheckHandler, ReferralInfoHandler, SurveyHandler,
)
from handlers.workflow import WorkflowWebhookHandler
from handlers.context import HandlerContext
from handlers.ratelimit import RateLimiter

# A route as tornado.web.Application takes it: pattern, handler, its initialize arguments.
Route = tuple[str, type[tornado.web.RequestHandler], dict[str, Any]] | tuple[
    str, type[tornado.web.RequestHandler]]


def routes(ctx: HandlerContext) -> list[Route]:
    public = {"ctx": ctx, "limiter": RateLimiter.from_settings(ctx.settings)}
    return [
        (r"/api/v1/webhooks/([a-z]+/[a-z_-]+)", WorkflowWebhookHandler, {"ctx": ctx}),
        (r"/api/v1/webhooks/card-processor", CardWebhookHandler, {"ctx": ctx}),
        (r"/api/v1/webhooks/crypto-processor", CryptoProcessorWebhookHandler, {"ctx": ctx}),
        (r"/api/v1/orders/([^/]+)/([^/]+)", OrderHandler, {"ctx": ctx}),
        (r"/healthz", HealthHandler, {"ctx": ctx}),
        (r"/readyz", ReadyHandler, {"ctx": ctx}),
        (r"/metrics", MetricsHandler, {"ctx": ctx}),
        (r"/api/v1/ifta/filed", FiledLinkHandler, {**public, "kind": "ifta"}),
        (r"/api/v1/ucr/filed", FiledLinkHandler, {**public, "kind": "ucr"}),
        (r"/api/v1/survey", SurveyHandler, public),
        (r"/api/v1/referral/check", ReferralCheckHandler, public),
        (r"/api/v1/referral/([^/]+)", ReferralInfoHandler, public),
        (r"/api/v1/dot/state-requirements", DotRequirementsHandler, public),
        (r"/api/v1/openapi.yaml", OpenApiHandler),
        *(console_routes(ctx) if ctx.settings.console_enabled else ()),
    ]
