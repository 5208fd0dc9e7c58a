"""Order alerts through the Telegram Bot API (sendMessage)."""
import logging

from clients.http import Result, post_json

log = logging.getLogger("receiver.alerts")


class TelegramClient:
    def __init__(self, http, settings):
        self.http = http
        self.settings = settings

    async def send(self, text):
        s = self.settings
        if not (s.telegram_bot_token and s.telegram_chat_id):
            log.info("alert not sent (TELEGRAM_BOT_TOKEN/TELEGRAM_CHAT_ID unset): %s", text)
            return Result(ok=True)
        return await post_json(
            self.http, f"{s.telegram_api_url}/bot{s.telegram_bot_token}/sendMessage",
            {"chat_id": s.telegram_chat_id, "text": text},
            timeout=s.outbound_timeout_seconds)
