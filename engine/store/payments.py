"""Card payments: the facts Stripe tells of an order's payment, disputes and refunds, settlement."""


class PaymentStore:
    """Card payments, in the caller's transaction."""
