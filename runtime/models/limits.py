"""How much free text a row keeps: a reason, a note, an error.

One number for both ends: the API and the forms refuse a longer reason or note a person or
an agent types (422, in the documented format), and what Holdpoint writes itself — an
exception's message, a tool's or an executor's error, a policy's refusal — is cut to it,
so neither a page nor a journal entry carries a stack of megabytes.
"""

NOTE_MAX = 2000
