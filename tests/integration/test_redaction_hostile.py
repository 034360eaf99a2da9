"""Redaction and the JSON depth scan against hostile text: every secret shape hidden, nothing else
changed where it says nothing secret, and every entry point answers the corpus."""
from __future__ import annotations

import json
import logging

import pytest
from django.contrib.auth.models import User
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from dispatcher.models import CallQueue
from dispatcher.redact import NOT_SECRET, REDACTED, RedactingFilter, redact, redact_text
from dispatcher.validation import MAX_JSON_DEPTH, json_text_depth
from tests.hostile_corpus import JSON_TEXTS, SECRET_SHAPES, STRINGS

SECRET = "hunter2zz"
TOKEN = "t0ken-for-redaction-tests"


@pytest.mark.parametrize("text", [
    "{'password': 'hunter2zz', 'user': 'ann'}",  # a Python repr
    "{'api_key': 'hunter2zz'}",
    "{\"password\": 12345hunter2zz}",  # a bare value
    "password = hunter2zz",
    "password=hunter2zz",
    'password="hunter2zz"',
    "api%5Fkey=hunter2zz",
    "client%5fsecret=hunter2zz&x=1",
    "Ocp-Apim-Subscription-Key: hunter2zz",
    "sent Ocp-Apim-Subscription-Key:hunter2zz to the API",
    "<password>hunter2zz</password>",
    "<ns:ApiKey type=\"x\">hunter2zz</ns:ApiKey>",
    "<Token>hunter2zz</Token>",
    "-----BEGIN RSA PRIVATE KEY-----\nMIIhunter2zz\n-----END RSA PRIVATE KEY-----",
    "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1hunter2zz",  # cut off before its end
    "https://ann:hunter2zz@api.example.com/",
    "Authorization: Bearer hunter2zz",
    # Inside the value of a name that is not secret: the value is scanned as any text.
    'note="retry password=hunter2zz"',
    "note='retry password=hunter2zz'",
    "note=password=hunter2zz",
    "a=1&b=c=password=hunter2zz",
    "note: api_key: hunter2zz",
    "X-Note: api_key: hunter2zz",
    'note="Authorization: Bearer hunter2zz"',
    "sent Authorization: Bearer hunter2zz to the API",
    # A quoted value longer than a line of text, or never closed.
    'password="' + "x" * 1200 + 'hunter2zz"',
    'password="hunter2zz and more',
    # The value is a container: hidden whole, whatever it holds.
    "<password><value>hunter2zz</value></password>",
    "<password><![CDATA[hunter2zz]]></password>",
    '<ns:ApiKey a="1"><v>hunter2zz</v></ns:ApiKey>',
    "<Token>\n  <v>hunter2zz</v>\n</Token>",
    "<password><a>hunter2zz",  # never closed
    '{"password": {"value": "hunter2zz"}}',
    '{"password": ["hunter2zz"]}',
    "{'api_key': {'v': 'hunter2zz'}}",
    '{"password": {"a": {"b": [{"c": "hunter2zz"}]}}}',
    '{"password": {"a": "]}\\"", "b": "hunter2zz"}}',
    "{'password': ('x', 'hunter2zz')}",
    "{'password': b'hunter2zz'}",
    "{'password': OrderedDict([('v', 'hunter2zz')])}",
    "password={'a': 'hunter2zz'}",
    'password=["hunter2zz"]',
    "password=('x', 'hunter2zz')",
    "password=SecretStr('hunter2zz')",
    'note: token: {"v": "hunter2zz"}',
    "Authorization: {\n  'v': 'hunter2zz'\n}",
    "password:\n  - hunter2zz",
    "password:\n  value: hunter2zz",
    "password: >-\n  hunter2zz",
    "  api_key:\n\n    hunter2zz\n",
])
def test_every_secret_shape_is_hidden(text):
    shown = redact_text(text)
    assert SECRET not in shown and REDACTED in shown


@pytest.mark.parametrize("params", [
    {"headers": {"Ocp-Apim-Subscription-Key": SECRET}},
    {"api%5Fkey": SECRET},
    {"body": f"<password>{SECRET}</password>"},
    {"repr": f"{{'password': '{SECRET}'}}"},
])
def test_secret_shapes_are_hidden_in_structured_values(params):
    assert SECRET not in json.dumps(redact(params))


@pytest.mark.parametrize("text", [
    "key=None", "password=null", "token=", "dispense key=None moved=3", "'password': None", "<password></password>",
    "the token expired", "sort_order=asc&page=2", "Content-Type: application/json", "<name>ann</name>",
    # Containers: under a name that is not secret, or empty.
    '{"user": {"name": "ann", "roles": ["a", "b"]}}', "<user><name>ann</name></user>", "note=['a', 'b']",
    "config:\n  debug: true\n  level: 2", "password:\nuser: ann", "password=[]", '{"password": {}}', "<password/><n>1</n>",
    "<password>\n</password>",
])
def test_text_that_holds_no_secret_is_shown_as_it_is(text):
    assert redact_text(text) == text


def test_the_log_filter_leaves_key_none_readable():
    record = logging.LogRecord("dispatcher", logging.INFO, __file__, 1, "dispense key=%s password=%s", (None, SECRET), None)
    RedactingFilter().filter(record)
    assert record.getMessage() == f"dispense key=None password={REDACTED}"


@pytest.mark.parametrize("text", STRINGS, ids=range(len(STRINGS)))
def test_the_corpus_is_redacted_and_scanned_without_error(text):
    shown = redact_text(text)
    assert isinstance(redact({"v": text, text[:50]: [text]}), dict)
    assert 0 <= json_text_depth(text) <= MAX_JSON_DEPTH + 1
    assert redact_text(shown) == shown  # what is shown is redacted already
    if text in SECRET_SHAPES:
        assert SECRET not in shown


@pytest.mark.parametrize("text", JSON_TEXTS, ids=range(len(JSON_TEXTS)))
def test_the_depth_scan_agrees_with_the_parser(text):
    depth = json_text_depth(text)
    if depth <= MAX_JSON_DEPTH:
        try:
            json.loads(text)  # never a RecursionError below the bound
        except ValueError:
            pass


# --- properties -------------------------------------------------------------------------------

names = st.sampled_from(["password", "api_key", "client_secret", "X-Api-Key", "access_token", "Ocp-Apim-Subscription-Key",
                         "api%5Fkey", "private_key", "session_id", "Authorization"])
# Words that say there is no secret (``key=None``, ``undefined``) stay readable on purpose (redact.NOT_SECRET).
values = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=6, max_size=30).filter(
    lambda value: value.lower() not in NOT_SECRET
)
shapes = st.sampled_from([
    "{n}={v}", "{n} = {v}", '"{n}": "{v}"', "'{n}': '{v}'", "{n}: {v}", "<{n}>{v}</{n}>", "?a=1&{n}={v}&b=2",
    "error: {{'{n}': '{v}'}} refused", "{n}:{v}",
    # escaped inside another string, an escaped quote in the value, joined, triple-quoted, ``=>``
    '"{{\\"{n}\\": \\"{v}\\"}}"', "'{{\\'{n}\\': \\'{v}\\'}}'", '{n}="a\\"{v}"', "{n} = 'ab' '{v}'",
    "{{'{n}': 'ab'\n '{v}'}}", '{n} = """a\n{v}"""', '"{n}" => "{v}"', "{n} => {v}",
])
noise = st.text(alphabet=" \n\t,;&=:'\"<>/abcxyz", max_size=30)


@settings(max_examples=300, deadline=None)
@given(names, values, shapes, noise, noise)
# Found in CI: the member ``':'`` before it took the quote that opens ``'password'`` as its value's.
@example("password", "000000", "'{n}': '{v}'", "':':'", "")
@example("api_key", "zzzzzz", "'{n}': '{v}'", "'password': '", "")
def test_a_secret_named_value_never_shows_whatever_surrounds_it(name, value, shape, before, after):
    assert value not in redact_text(framed(name, value, shape, before, after))


def framed(name: str, value: str, shape: str, before: str, after: str) -> str:
    """The shape with this name (an element's name where the shape is one) and value, on a line
    of its own between two noise texts."""
    if shape.startswith("<"):
        name = name.replace("-", "_").replace("%5F", "_")  # an element name
    assume(value not in before + after)  # the noise's letters may spell the value
    return before + "\n" + shape.format(n=name, v=value) + "\n" + after


# A construct whose name is not secret, its value holding the secret shape: a pair (quoted or
# not), a header, a member, an element.
holders = st.sampled_from([
    'note="{}"', "note='{}'", "note={}", "note: {}", "X-Note: {}", '{{"note": "{}"}}', "<note>{}</note>", "a=1&b={}",
])


@settings(max_examples=300, deadline=None)
@given(names, values, shapes, holders, noise)
def test_a_secret_named_value_never_shows_inside_another_names_value(name, value, shape, holder, before):
    if shape.startswith("<"):
        name = name.replace("-", "_").replace("%5F", "_")  # an element name
    assume(value not in before)
    text = before + holder.format(shape.format(n=name, v=value))
    assert value not in redact_text(text)


# A secret name whose value is a container (XML children, a JSON or repr object, array or tuple,
# a constructor's call, an indented YAML block).
containers = st.sampled_from([
    "{n}={{'a': '{v}'}}", "{n}=['x', \"{v}\"]", "{n} = ('x', '{v}')", "{n}=SecretStr('{v}')", "{n}=b'{v}'",
    "{{'{n}': {{'a': ['{v}']}}}}", '{{"{n}": ["x", "{v}"]}}', "{{'{n}': ('x', '{v}')}}", '{{"{n}": {{"a": "]}}\\"", "b": "{v}"}}}}',
    "<{n}><a>{v}</a></{n}>", "<{n}><![CDATA[{v}]]></{n}>", "<{n}>x<b/>{v}</{n}>",
    "{n}:\n  - {v}", "{n}:\n  a: {v}", "{n}: |\n  {v}", '{n}: {{\n  "a": "{v}"\n}}', "note {n}: ['x', '{v}']",
    "[{n}]\nvalue = {v}\nuser = {v}",  # an INI section (its header on a line of its own)
])


@settings(max_examples=300, deadline=None)
@given(names, values, containers, noise, noise)
def test_a_secret_named_container_never_shows_what_it_holds(name, value, shape, before, after):
    assert value not in redact_text(framed(name, value, shape, before, after))


# A secret named by a sibling (a name/value pair object, .NET config), or in a secret element's
# attributes.
siblings = st.sampled_from([
    '{{"name": "{n}", "value": "{v}"}}', "{{'Key': '{n}', 'Value': '{v}'}}", '[{{"value": "{v}", "Name": "{n}"}}]',
    '{{"key": "{n}", "type": "s", "val": ["{v}"]}}', '<add key="{n}" value="{v}"/>', "<setting name='{n}' value='{v}'>",
    '<{n} value="{v}"/>', "<{n} a='1' v='{v}'></{n}>",
    '<setting name="{n}"><value>{v}</value></setting>', "<entry key='{n}'>x <b/>{v}</entry>", "name={n}&value={v}",
    "value={v}&key={n}&n=1",
])


@settings(max_examples=300, deadline=None)
@given(names, values, siblings, noise, noise)
def test_a_secret_named_by_a_sibling_never_shows(name, value, shape, before, after):
    assert value not in redact_text(framed(name, value, shape, before, after))


@pytest.mark.parametrize("shape", [
    "<password><value>hunter2zz</value></password>", '{"password": {"value": ["hunter2zz", "]"]}}',
    "{'password': ('x', 'hunter2zz')}", "password={'a': 'hunter2zz'}", "password=[\"hunter2zz\"]",
    "note password: ['hunter2zz']", "password:\n  - hunter2zz\n",
])
@pytest.mark.parametrize("sibling", ["\n<user>ann</user>", ", 'user': 'ann'", ", user=ann", "\nuser: ann"])
def test_what_follows_a_hidden_container_stays_readable(shape, sibling):
    shown = redact_text(shape + sibling)
    assert SECRET not in shown and shown.endswith(sibling.lstrip(",\n"))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_redaction_never_fails_and_is_stable(text):
    once = redact_text(text)
    assert redact_text(once) == once


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{}', max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k"\\[', max_size=3), inner, max_size=3),
    max_leaves=30,
)


def depth_of(value) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_the_depth_scan_measures_what_the_parser_would_nest(value):
    assert json_text_depth(json.dumps(value)) == min(depth_of(value), MAX_JSON_DEPTH + 1)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet='[]{}"\\a,:', max_size=200))
def test_the_depth_scan_never_undercounts_what_the_parser_would_reach(text):
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return
    assert json_text_depth(text) >= min(depth_of(value), MAX_JSON_DEPTH + 1)


# --- entry points ----------------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize("text", JSON_TEXTS, ids=range(len(JSON_TEXTS)))
def test_the_api_answers_hostile_json_bodies(client, settings, text):
    settings.DISPATCHER_API_TOKENS = TOKEN
    response = client.post("/api/calls/", data=text, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 400


@pytest.mark.django_db
def test_pages_of_a_call_with_long_hostile_params_answer_and_hide_the_secret(client, settings, make_call):
    settings.DISPATCHER_API_TOKENS = TOKEN
    long = {f"p{i}": s for i, s in enumerate(STRINGS) if len(s) > 1000}
    # Stored as under a raised DISPATCHER_MAX_PARAMS_BYTES: about 1.8 MB of hostile text.
    call = make_call("noop", {}, status="failed", last_error=("a=" * 30_000) + f" password={SECRET}",
                     result={"body": "\n" * 100_000 + f"token={SECRET}"})
    CallQueue.objects.filter(id=call.id).update(params={**long, "password": SECRET})
    client.force_login(User.objects.create_superuser("root", password="pw"))
    page = client.get(f"/admin/dispatcher/callqueue/{call.id}/change/")
    assert page.status_code == 200 and SECRET not in page.content.decode()
    listed = client.get("/admin/dispatcher/callqueue/", {"q": "a=a=a="})
    assert listed.status_code == 200
    shown = client.get(f"/api/calls/{call.id}/", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert shown.status_code == 200 and SECRET not in shown.content.decode()
