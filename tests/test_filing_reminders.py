"""IFTA and UCR reminders: the schedule across a quarter end that crosses the year end
(IFTA Q4, due Jan 31) and across a year end (UCR, due Dec 31), a click on the e-mail's
link in between, one consolidated e-mail per customer per day, the business time zone,
and two processes on PostgreSQL. A fixed clock, a real SMTP server, the link clicked over
HTTP as a customer's mail app would."""
import asyncio
import collections
import dataclasses
import datetime
import re
import zoneinfo

import pytest

from domain import filings
from domain.reminders import send_reminders
from models import ComplianceOrder, SelfFiling, SentReminder
from settings import ConfigurationError, Settings
from tests.service_process import postgres_only
from tests.test_cli import cli_env, run_async
from tests.test_faults import figures

LINK = re.compile(r"(http://\S+/api/v1/(ifta|ucr)/filed\?\S+)")


def paid(number, slug, email="ada@example.test", **fields):
    return ComplianceOrder.create(**{
        "order_number": number, "service_slug": slug, "payment_status": "paid",
        "customer_email": email, "customer_name": "Ada",
        "service_name": f"{slug.upper()} filing", **fields})


def texts(smtp, to="ada@example.test"):
    return [(message["Subject"], message.get_body(("plain",)).get_content(),
             message.get_body(("html",)).get_content())
            for rcpt, message in smtp.messages if rcpt == [to]]


async def run_days(ctx, clock, smtp, start, days, runs_a_day=4):
    """The job runs `runs_a_day` times a day, `days` days long from `start` (00:30 UTC).
    Returns {day: subjects mailed that day}."""
    mailed = collections.defaultdict(list)
    clock.set(*start, 0, 30)
    for _ in range(days * runs_a_day):
        before = len(smtp.messages)
        await send_reminders(ctx)
        for _, message in smtp.messages[before:]:
            mailed[clock().date()].append(message["Subject"])
        clock.advance(hours=24 // runs_a_day)
    return mailed


def on(*dates):
    return [datetime.date(*d) for d in dates]


# --- the calendar -----------------------------------------------------------------------

@pytest.mark.parametrize("year,quarter,due", [
    (2026, 1, (2026, 4, 30)), (2026, 2, (2026, 7, 31)), (2026, 3, (2026, 10, 31)),
    (2026, 4, (2027, 1, 31)), (2027, 4, (2028, 1, 31))])
def test_an_ifta_return_is_due_the_last_day_of_the_month_after_its_quarter(year, quarter, due):
    cycle = filings.ifta_cycle(year, quarter)
    assert (cycle.label, cycle.due) == (f"{year}-Q{quarter}", datetime.date(*due))


def test_a_ucr_registration_is_due_december_31_of_the_year_before():
    cycle = filings.ucr_cycle(2027)
    assert (cycle.label, cycle.due) == ("2027", datetime.date(2026, 12, 31))


@pytest.mark.parametrize("day,expected", [
    ((2027, 1, 16), None), ((2027, 1, 17), 14), ((2027, 1, 20), 14), ((2027, 1, 24), 7),
    ((2027, 1, 28), 3), ((2027, 1, 29), 3), ((2027, 1, 30), 1), ((2027, 1, 31), 0),
    ((2027, 2, 1), None)])
def test_the_reminder_due_on_a_day_is_the_latest_that_has_come(day, expected):
    cycle = filings.ifta_cycle(2026, 4)
    assert filings.reminder_due(cycle, datetime.date(*day), (14, 7, 3, 1)) == expected


def test_the_reminder_days_are_a_setting():
    assert Settings.from_env({}).filing_reminder_days == (14, 7, 3, 1)
    assert Settings.from_env({"FILING_REMINDER_DAYS": "2, 10,5"}).filing_reminder_days == (
        10, 5, 2)
    for bad in ("7,x", "0", "-3", "1.5"):
        with pytest.raises(ConfigurationError, match="FILING_REMINDER_DAYS"):
            Settings.from_env({"FILING_REMINDER_DAYS": bad})
    assert Settings.from_env({"IFTA_SERVICE_SLUGS": "ifta, ifta-quarterly",
                              "UCR_SERVICE_SLUGS": "ucr-annual"}).ifta_service_slugs == (
        "ifta", "ifta-quarterly")


# --- the schedule ------------------------------------------------------------------------

@pytest.mark.gen_test(timeout=60)
async def test_ifta_q4_reminders_cross_the_year_end_and_stop_after_the_due_date(
        ctx, clock, smtp):
    paid("CO-1", "ifta")
    mailed = await run_days(ctx, clock, smtp, (2026, 12, 28), days=40)
    assert sorted(mailed) == on((2027, 1, 17), (2027, 1, 24), (2027, 1, 28), (2027, 1, 30),
                                (2027, 1, 31))
    assert all(subjects == ["Your IFTA return for 2026-Q4 is due January 31, 2027"]
               for subjects in mailed.values())
    subject, text, html = texts(smtp)[0]
    for body in (text, html):
        for fact in ("CO-1", "Q4 2026 (October to December)", "Sunday, January 31, 2027",
                     "/api/v1/ifta/filed?order=CO-1&amp;cycle=2026-Q4" if body is html
                     else "/api/v1/ifta/filed?order=CO-1&cycle=2026-Q4"):
            assert fact in body
    assert SentReminder.select().where(SentReminder.kind == "ifta").count() == 5


@pytest.mark.gen_test(timeout=60)
async def test_ucr_reminders_cross_the_year_end(ctx, clock, smtp):
    paid("CO-2", "ucr")
    mailed = await run_days(ctx, clock, smtp, (2026, 12, 1), days=40)
    assert sorted(mailed) == on((2026, 12, 17), (2026, 12, 24), (2026, 12, 28),
                                (2026, 12, 30), (2026, 12, 31))
    assert set(sum(mailed.values(), [])) == {"Your UCR registration for 2027 is due "
                                             "December 31, 2026"}
    _, text, _ = texts(smtp)[0]
    assert "registration year 2027" in text and "Thursday, December 31, 2026" in text


@pytest.mark.gen_test(timeout=60)
async def test_a_click_on_the_link_in_between_stops_the_rest_of_that_cycle(
        ctx, clock, smtp, http_server, base_url, client):
    ctx.settings = dataclasses.replace(ctx.settings, public_base_url=base_url)
    paid("CO-1", "ifta")
    mailed = await run_days(ctx, clock, smtp, (2027, 1, 17), days=8)  # the 14- and 7-day ones
    assert sorted(mailed) == on((2027, 1, 17), (2027, 1, 24))

    [(link, _)] = set(LINK.findall(texts(smtp)[-1][1]))
    response = await client.fetch(link)  # what a mail scanner fetches too: records nothing
    assert response.code == 200 and SelfFiling.select().count() == 0
    path, _, query = link.partition("?")
    response = await client.fetch(path, method="POST", body=query)  # the page's button
    assert response.code == 200 and SelfFiling.select().count() == 1

    assert await run_days(ctx, clock, smtp, (2027, 1, 25), days=10) == {}
    # The next quarter's reminders are another cycle's: they come.
    mailed = await run_days(ctx, clock, smtp, (2027, 4, 15), days=2)
    assert sum(mailed.values(), []) == ["Your IFTA return for 2027-Q1 is due April 30, 2027"]


@pytest.mark.gen_test
async def test_one_consolidated_mail_a_day_across_intake_ifta_and_ucr(ctx, clock, smtp):
    # With a 31-day reminder, IFTA Q4 (due Jan 31) and UCR 2027 (due Dec 31) share Dec 31.
    ctx.settings = dataclasses.replace(ctx.settings, filing_reminder_days=(31,))
    paid("CO-1", "ifta")
    paid("CO-2", "UCR", email="Ada@Example.test")
    ComplianceOrder.create(order_number="CO-3", customer_email="ada@example.test",
                           fulfillment_status="awaiting_intake")
    paid("CO-4", "ucr", email="bob@example.test")

    await run_days(ctx, clock, smtp, (2026, 12, 31), days=1, runs_a_day=24)

    [(subject, text, html)] = texts(smtp)
    assert subject == "3 reminders about your orders"
    for body in (text, html):
        for fact in ("CO-1", "CO-2", "CO-3", "2026-Q4", "2027", "intake form"):
            assert fact in body
    assert len(set(LINK.findall(text))) == 2
    assert [s for s, _, _ in texts(smtp, "bob@example.test")] == [
        "Your UCR registration for 2027 is due December 31, 2026"]
    assert ComplianceOrder.get(ComplianceOrder.order_number == "CO-3").intake_reminders_sent == 1


@pytest.mark.gen_test
async def test_a_filing_reminder_due_after_todays_mail_waits_for_tomorrow(ctx, clock, smtp):
    ComplianceOrder.create(order_number="CO-3", customer_email="ada@example.test",
                           fulfillment_status="awaiting_intake")
    clock.set(2027, 1, 17, 0, 30)
    await send_reminders(ctx)           # the intake reminder
    paid("CO-1", "ifta")                # paid later that day, its 14-day reminder due
    clock.set(2027, 1, 17, 18, 0)
    await send_reminders(ctx)
    assert len(smtp.messages) == 1
    clock.set(2027, 1, 18, 0, 30)
    await send_reminders(ctx)
    subjects = [s for s, _, _ in texts(smtp)]
    assert subjects[1] == "2 reminders about your orders"  # intake again, and the IFTA one
    assert SentReminder.get(SentReminder.kind == "ifta").key == "ifta|CO-1|2026-Q4|14"


@pytest.mark.gen_test
async def test_who_is_not_reminded(ctx, clock, smtp):
    paid("CO-1", "ifta", payment_status="pending_payment")
    paid("CO-2", "ifta", subscription_status="cancelled")
    paid("CO-3", "ifta", cancelled_at=datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC))
    paid("CO-4", "ifta", email=None)
    paid("CO-5", "ifta", email="   ")
    paid("CO-6", "boi-report")
    paid("CO-7", "ifta-quarterly")
    clock.set(2027, 1, 17, 9, 0)
    assert await send_reminders(ctx) == 0
    ctx.settings = dataclasses.replace(ctx.settings, ifta_service_slugs=("ifta-quarterly",))
    assert await send_reminders(ctx) == 1
    assert "CO-7" in texts(smtp)[0][1]


@pytest.mark.gen_test
async def test_a_day_is_a_day_in_the_business_time_zone(ctx, clock, smtp):
    ctx.settings = dataclasses.replace(ctx.settings, business_tz="America/Vancouver")
    paid("CO-1", "ucr")
    clock.set(2026, 12, 17, 7, 59)  # 23:59 on 16 December in Vancouver: 15 days before
    assert await send_reminders(ctx) == 0
    clock.set(2026, 12, 17, 8, 1)
    assert await send_reminders(ctx) == 1
    local = clock().astimezone(zoneinfo.ZoneInfo("America/Vancouver")).date()
    assert SentReminder.get(SentReminder.kind == "mail").day == local.isoformat()


# --- the command line, and two processes ------------------------------------------------

def ucr_due_in(days):
    """Reminder days that make a UCR reminder due today (the real date, in UTC), for a
    subprocess that runs on the real clock."""
    today = datetime.datetime.now(datetime.UTC).date()
    cycle = filings.ucr_cycle(today.year + 1)
    return str((cycle.due - today).days), cycle


@pytest.mark.gen_test(timeout=60)
async def test_reminders_list_and_run_on_the_command_line(database_url, settings, smtp):
    days, cycle = ucr_due_in(0)
    env = {**cli_env(database_url, settings), "FILING_REMINDER_DAYS": days}
    paid("CO-9", "ucr")
    listed = await run_async(env, "reminders", "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split() == [
        "ada@example.test", "ucr", "CO-9", cycle.label, cycle.due.isoformat(), "next", "run"]
    ran = await run_async(env, "reminders", "run")
    assert (ran.returncode, ran.stdout.strip()) == (0, "queued 1 reminder e-mail(s)")
    assert len(smtp.messages) == 1
    again = await run_async(env, "reminders", "run")
    assert again.stdout.strip() == "queued 0 reminder e-mail(s)"
    assert (await run_async(env, "reminders", "list")).stdout.splitlines()[1:] == []
    ComplianceOrder.create(order_number="CO-10", customer_email="ada@example.test",
                           fulfillment_status="awaiting_intake")
    [waiting] = (await run_async(env, "reminders", "list")).stdout.splitlines()[1:]
    assert waiting.split()[:3] == ["ada@example.test", "intake", "CO-10"]
    assert waiting.endswith("tomorrow (mailed today)")


@postgres_only
@pytest.mark.gen_test(timeout=120)
async def test_two_processes_running_at_once_never_send_a_reminder_twice(
        database_url, settings, smtp):
    days, _ = ucr_due_in(0)
    env = {**cli_env(database_url, settings), "FILING_REMINDER_DAYS": days}
    customers = [f"c{n}@example.test" for n in range(20)]
    for n, email in enumerate(customers):
        paid(f"CO-{n}", "ucr", email=email)
        ComplianceOrder.create(order_number=f"CO-I{n}", customer_email=email,
                               fulfillment_status="awaiting_intake")
    for _ in range(3):
        runs = await asyncio.gather(*(run_async(env, "reminders", "run") for _ in range(2)))
        assert [run.returncode for run in runs] == [0, 0], [run.stderr for run in runs]
    received = collections.Counter(rcpt[0] for rcpt, _ in smtp.messages)
    assert received == {email: 1 for email in customers}
    assert SentReminder.select().count() == 40  # a mail and a UCR reminder per customer
    assert {o.intake_reminders_sent for o in ComplianceOrder.select().where(
        ComplianceOrder.fulfillment_status == "awaiting_intake")} == {1}
    figures("reminders, two processes x 3 runs at once", customers=len(customers),
            emails=len(smtp.messages), duplicated=sum(received.values()) - len(received),
            keys=SentReminder.select().count())


@pytest.mark.gen_test
async def test_a_run_that_lost_its_filing_reminder_to_a_run_past_midnight_mails_nothing(
        ctx, clock, smtp):
    from domain import reminders
    from engine.transaction import Transaction
    paid("CO-1", "ifta")
    day = datetime.date(2027, 1, 17)
    clock.set(2027, 1, 17, 23, 59)
    [entry] = await ctx.db(lambda: reminders.plan(ctx, Transaction(ctx), day))  # this run plans the reminder
    clock.set(2027, 1, 18, 0, 1)
    await send_reminders(ctx)               # ... which another run sends after midnight
    tx = Transaction(ctx)
    await ctx.db(lambda: reminders._remind(ctx, tx, entry, day))
    assert tx.rows == [] and len(smtp.messages) == 1
