"""Order alerts through the Telegram Bot API (sendMessage)."""
import logging

from clients.http import HttpClient, Request, Result, post_json
from settings import Settings

log = logging.getLogger("receiver.alerts")


class TelegramClient:
    def __init__(self, http: HttpClient, settings: Settings) -> None:
        self.http = http
        self.settings = settings

    @property
    def configured(self) -> bool:
        return bool(self.settings.telegram_bot_token and self.settings.telegram_chat_id)

    async def send(self, text: str) -> Result:
        """Without a bot and a chat the alert is logged, and the Result says so."""
        s = self.settings
        if not self.configured:
            log.info("alert not sent (TELEGRAM_BOT_TOKEN/TELEGRAM_CHAT_ID unset): %s", text)
            return Result.only_logged("TELEGRAM_BOT_TOKEN/TELEGRAM_CHAT_ID unset: "
                                      "logged, not sent")
        request = self.request(text)
        return await post_json(self.http, request.url, request.body,
                               timeout=s.outbound_timeout_seconds, peer="Telegram")

    def request(self, text: str) -> Request:
        """The bot's token is part of the URL."""
        s = self.settings
        return Request(f"{s.telegram_api_url}/bot{s.telegram_bot_token}/sendMessage",
                       {"chat_id": s.telegram_chat_id, "text": text})
