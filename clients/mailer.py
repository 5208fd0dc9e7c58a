"""SMTP mail. Sending runs in a worker thread so the IOLoop never waits on a mail server.

SMTP_URL: smtp://[user:pass@]host[:port] (STARTTLS when the server offers it),
smtp+starttls://... (STARTTLS required) or smtps://... (TLS from the start).
Unset: each message is logged (recipients and subject only) instead of sent.
"""
import asyncio
import concurrent.futures
import email.message
import email.utils
import hashlib
import logging
import re
import smtplib
import ssl
import urllib.parse
from typing import Callable

from clients.http import Result
from settings import Settings

log = logging.getLogger("receiver.mail")

# Codes a mail server uses to refuse a message for good; anything else may pass later.
PERMANENT_SMTP_CODES = range(500, 600)


class Mailer:
    def __init__(self, settings: Settings,
                 executor: concurrent.futures.Executor | None = None) -> None:
        self.settings = settings
        self.executor = executor

    @property
    def configured(self) -> bool:
        return bool(self.settings.smtp_url)

    async def send(self, to: list[str], subject: str, text: str, html: str | None = None,
                   before: Callable[[], object] | None = None,
                   key: str | None = None) -> Result:
        """`before`, if given, is called in the mail thread right before the message goes
        out (after any wait for a free thread); an exception from it sends nothing. `key`
        (the outbox row's idempotency key) makes the Message-ID the same on every retry."""
        if not self.configured:
            if before is not None:
                before()
            log.info("mail not sent (SMTP_URL unset): to=%s subject=%r", ",".join(to), subject)
            return Result.only_logged("SMTP_URL unset: logged, not sent")
        message = self.compose(to, subject, text, html, key)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._deliver, message, before)

    def compose(self, to: list[str], subject: str, text: str, html: str | None = None,
                key: str | None = None) -> email.message.EmailMessage:
        message = email.message.EmailMessage()
        message["From"] = self.settings.mail_from
        message["To"] = ", ".join(to)
        # A line break in a header would start another header (header injection).
        message["Subject"] = re.sub(r"[\r\n]+", " ", subject)
        message["Date"] = email.utils.formatdate(usegmt=True)
        if key:
            # A mail server or client that drops repeats by Message-ID then sees a send
            # repeated after a lost outcome as one message. Hashed: a key may hold
            # characters a Message-ID cannot.
            digest = hashlib.sha256(key.encode()).hexdigest()[:40]
            message["Message-ID"] = f"<{digest}@receiver>"
        else:
            message["Message-ID"] = email.utils.make_msgid(domain="receiver")
        message.set_content(text)
        if html:
            message.add_alternative(html, subtype="html")
        return message

    def _deliver(self, message: email.message.EmailMessage,
                 before: Callable[[], object] | None = None) -> Result:
        if before is not None:
            before()
        url = urllib.parse.urlsplit(self.settings.smtp_url)
        timeout = self.settings.outbound_timeout_seconds
        try:
            client: smtplib.SMTP
            if url.scheme == "smtps":
                client = smtplib.SMTP_SSL(url.hostname or "", url.port or 465, timeout=timeout,
                                          context=ssl.create_default_context())
            else:
                client = smtplib.SMTP(url.hostname or "", url.port or 25, timeout=timeout)
            with client:
                client.ehlo()
                if url.scheme == "smtp+starttls" or (
                        url.scheme == "smtp" and client.has_extn("starttls")):
                    client.starttls(context=ssl.create_default_context())
                    client.ehlo()
                if url.username:
                    client.login(urllib.parse.unquote(url.username),
                                 urllib.parse.unquote(url.password or ""))
                client.send_message(message)
        except smtplib.SMTPResponseException as exc:
            return Result.failed(f"SMTP {exc.smtp_code}",
                                 retryable=exc.smtp_code not in PERMANENT_SMTP_CODES)
        except smtplib.SMTPRecipientsRefused as exc:
            return Result.failed(f"recipients refused: {', '.join(exc.recipients)}",
                                 retryable=False)
        except (OSError, smtplib.SMTPException) as exc:
            return Result.failed(f"{type(exc).__name__}: {exc}")
        return Result(ok=True)
