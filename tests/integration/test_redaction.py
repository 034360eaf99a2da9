"""Secrets in URLs, form data and headers are redacted in the admin, the API, the logs and the metrics."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client

from dispatcher.clock import db_now
from dispatcher.exceptions import InvalidParams
from dispatcher.models import Attempt, CallQueue
from dispatcher.redact import REDACTED, redact, redact_text
from support.processes import wait_until

SECRETS = ["SEKRIT-1", "SEKRIT-2", "SEKRIT-3", "SEKRIT-4", "SEKRIT-5", "SEKRIT-6"]
PARAMS = {
    "url": "https://api.example.com/v1/items?api_key=SEKRIT-1&page=2&signature=SEKRIT-2",
    "data": "grant_type=client_credentials&client_secret=SEKRIT-3",
    "headers": {"X-Access-Key": "SEKRIT-4", "X-Request-Id": "req-7"},
    "callback": "https://hooks.example.com/x?token=SEKRIT-5&sig=SEKRIT-6",
}
ERROR = "HTTPStatusError: 500 for url 'https://api.example.com/v1?api_key=SEKRIT-1'\nX-Access-Key: SEKRIT-4"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://h/p?api_key=abc&q=1", f"https://h/p?api_key={REDACTED}&q=1"),
        ("https://h/p?token=abc#frag", f"https://h/p?token={REDACTED}#frag"),
        ("https://h/p?X-Amz-Signature=abc&X-Amz-Credential=def", f"https://h/p?X-Amz-Signature={REDACTED}&X-Amz-Credential={REDACTED}"),
        ("https://h/p?key=AIza123&keys=a", f"https://h/p?key={REDACTED}&keys=a"),
        ("client_id=app&client_secret=xyz", f"client_id=app&client_secret={REDACTED}"),
        ("https://ada:hunter2@h/", f"https://ada:{REDACTED}@h/"),
        ("X-Access-Key: AKIA\nAccept: */*", f"X-Access-Key: {REDACTED}\nAccept: */*"),
        ('{"password": "hunter2", "user": "ada"}', f'{{"password": "{REDACTED}", "user": "ada"}}'),
        ("Illegal header value b'Bearer abc\\n'", f"Illegal header value b'Bearer {REDACTED}\\n'"),
        ("the token expired", "the token expired"),
        ("RuntimeError: boom", "RuntimeError: boom"),
        ("sent X-Access-Key: AKIA1 and more", f"sent X-Access-Key: {REDACTED} and more"),
        ("https://h/x and http://h:8080/y", "https://h/x and http://h:8080/y"),
    ],
)
def test_redact_text_hides_secret_values_and_keeps_the_rest(text, expected):
    assert redact_text(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # XML: the whole content of a secret-named element, to its own close tag.
        ("<password><value>hunter2zz</value></password><user>ann</user>", f"<password>{REDACTED}</password><user>ann</user>"),
        ("<password><![CDATA[hunter2zz]]></password><user>ann</user>", f"<password>{REDACTED}</password><user>ann</user>"),
        # A secret element's attributes are the secret's too.
        ('<ns:ApiKey a="1"><v>hunter2zz</v></ns:ApiKey><n>1</n>', f'<ns:ApiKey a="{REDACTED}">{REDACTED}</ns:ApiKey><n>1</n>'),
        ("<secret>hun<b/>ter2zz</secret> sent", f"<secret>{REDACTED}</secret> sent"),
        ("<key><key>a</key>hunter2zz</key><n>1</n>", f"<key>{REDACTED}</key><n>1</n>"),
        ("<password><![CDATA[</password>hunter2zz]]></password><n>1</n>", f"<password>{REDACTED}</password><n>1</n>"),
        ("<password><!-- </password> -->hunter2zz</password><n>1</n>", f"<password>{REDACTED}</password><n>1</n>"),
        ('<password a="/>">hunter2zz</password><n>1</n>', f'<password a="{REDACTED}">{REDACTED}</password><n>1</n>'),
        ("<note><password>hunter2zz</password></note>", f"<note><password>{REDACTED}</password></note>"),
        ("body: <data><password>hunter2zz", f"body: <data><password>{REDACTED}"),  # cut off: to the end
        # JSON and Python reprs: the whole container, to its matching bracket.
        ('{"password": {"value": "hunter2zz"}, "user": "ann"}', f'{{"password": {REDACTED}, "user": "ann"}}'),
        ('{"password": ["hunter2zz"], "user": "ann"}', f'{{"password": {REDACTED}, "user": "ann"}}'),
        ("{'api_key': {'v': 'hunter2zz'}, 'user': 'ann'}", f"{{'api_key': {REDACTED}, 'user': 'ann'}}"),
        ('{"password": {"a": "x}]\\"y", "b": [["hunter2zz"]]}, "user": "ann"}', f'{{"password": {REDACTED}, "user": "ann"}}'),
        ("{'password': {'a': ')}]\\'', 'b': 'hunter2zz'}, 'user': 'ann'}", f"{{'password': {REDACTED}, 'user': 'ann'}}"),
        ("{'auth': ('ann', 'hunter2zz'), 'timeout': 5}", f"{{'auth': {REDACTED}, 'timeout': 5}}"),
        ("{'password': b'hunter2zz', 'user': 'ann'}", f"{{'password': {REDACTED}, 'user': 'ann'}}"),
        ("{'token': SecretStr('hunter2zz'), 'user': 'ann'}", f"{{'token': {REDACTED}, 'user': 'ann'}}"),
        ("{'password': {'a': 'x',\n              'b': 'hunter2zz'},\n 'user': 'ann'}", f"{{'password': {REDACTED},\n 'user': 'ann'}}"),
        ('error: {"password": {"a": "hunter2zz"', f'error: {{"password": {REDACTED}'),  # cut off: to the end
        # name=, name: followed by a container.
        ("password={'a': 'hunter2zz'} user=ann", f"password={REDACTED} user=ann"),
        ('password=["hunter2zz"], user=ann', f"password={REDACTED}, user=ann"),
        ('password = [ "x", "hunter2zz" ] user=ann', f"password = {REDACTED} user=ann"),
        ("Request(auth=('ann', 'hunter2zz'), timeout=5)", f"Request(auth={REDACTED}, timeout=5)"),
        ("password=b'hunter2zz' user=ann", f"password={REDACTED} user=ann"),
        ('sent password: ["a b", "hunter2zz"] to the API', f"sent password: {REDACTED} to the API"),
        ('sent token: "hunter2zz and more" to the API', f"sent token: {REDACTED} to the API"),
        ('password: {\n  "a": "hunter2zz"\n}\nuser: ann', f"password: {REDACTED}\nuser: ann"),
        # YAML: a name with no value on its line owns the lines indented below it.
        ("password:\n  - hunter2zz\nuser: ann", f"password: {REDACTED}\nuser: ann"),
        ("password:\n  value: hunter2zz\n\nuser: ann", f"password: {REDACTED}\n\nuser: ann"),
        ("password:\n- hunter2zz\nuser: ann", f"password: {REDACTED}\nuser: ann"),
        ("db:\n  password: |\n    hunter2zz\n  user: ann", f"db:\n  password: {REDACTED}\n  user: ann"),
        ("- password:\n    value: hunter2zz\n  user: ann", f"- password: {REDACTED}\n  user: ann"),
        ('"password":\n  value: hunter2zz\nuser: ann', f'"password": {REDACTED}\nuser: ann'),
        ("password:\r\n  value: hunter2zz\r\nuser: ann", f"password: {REDACTED}\r\nuser: ann"),
        ("password: &db\n  - hunter2zz\nuser: ann", f"password: {REDACTED}\nuser: ann"),
        ("password: !!binary |\n  aHVudGVyMnp6\nuser: ann", f"password: {REDACTED}\nuser: ann"),
        ("password: 'hun\n  ter2zz'\nuser: ann", f"password: {REDACTED}\nuser: ann"),
    ],
)
def test_a_secret_names_container_value_is_hidden_whole_and_what_follows_it_stays(text, expected):
    assert redact_text(text) == expected


def test_redact_hides_secrets_inside_strings_of_params():
    shown = str(redact(PARAMS))
    assert not any(secret in shown for secret in SECRETS)
    assert "page=2" in shown and "req-7" in shown and "grant_type=client_credentials" in shown


def test_the_http_handler_refuses_a_credential_header_in_clear(settings):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["127.0.0.1"]
    with pytest.raises(InvalidParams, match="credential"):
        CallQueue.objects.send("http", {"method": "GET", "url": "http://127.0.0.1/", "headers": {"X-Access-Key": "k"}})


@pytest.mark.django_db
def test_admin_and_api_show_no_secret_from_params_result_error_traceback_or_attempts(settings):
    settings.DISPATCHER_API_TOKENS = "api-token"
    call = CallQueue.objects.send("noop", PARAMS, keys=["partner"])
    CallQueue.objects.filter(id=call.id).update(
        status="failed", last_error=ERROR, last_traceback=f"Traceback ...\n{ERROR}",
        result={"echo": PARAMS["url"]}, finished_at=db_now(),
    )
    now = db_now()
    Attempt.objects.create(call=call, number=1, started_at=now - timedelta(seconds=1), finished_at=now, outcome="error", error=ERROR)
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(content_type__app_label="dispatcher", codename="view_callqueue"))
    client = Client()
    client.force_login(user)
    page = client.get(f"/admin/dispatcher/callqueue/{call.id}/change/").content.decode()
    api = client.get(f"/api/calls/{call.id}/", HTTP_AUTHORIZATION="Bearer api-token").content.decode()
    for shown in (page, api):
        assert not [secret for secret in SECRETS if secret in shown]
        assert "HTTPStatusError: 500" in shown
    assert "req-7" in page and "page=2" in page
    # Nor can a search find a call by a secret's text.
    found = client.get("/admin/dispatcher/callqueue/", {"q": "SEKRIT"}).context["cl"].result_list
    assert list(found) == []


@pytest.mark.django_db
def test_metrics_labels_carry_no_secret(client, settings):
    settings.DISPATCHER_METRICS_TOKENS = "m-token"
    CallQueue.objects.send("noop", {}, keys=["https://h/?api_key=SEKRIT-1"])
    text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer m-token").content.decode()
    assert "dispatcher_queue_depth" in text and "SEKRIT-1" not in text and "api_key=********" in text


@pytest.mark.postgres
@pytest.mark.slow
def test_a_real_workers_log_lines_carry_no_secret(procs):
    call = CallQueue.objects.send("leaky", {"url": "https://api.example.com/v1?api_key=SEKRIT-1"}, max_attempts=1)
    procs.worker(procs.queue, concurrency=1)
    procs.dispenser()
    assert wait_until(lambda: CallQueue.objects.get(id=call.id).status == "failed", timeout=60, interval=0.3), procs.logs()
    logs = procs.logs()
    assert f"call={call.id}" in logs and "api_key=********" in logs
    leaks = [line for line in logs.splitlines() if "SEKRIT-1" in line or "LEAK-" in line]
    assert leaks == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # JSON or a repr escaped inside another string: names and values in escaped quotes.
        ('"{\\"password\\": \\"hunter2zz\\", \\"user\\": \\"ann\\"}"', f'"{{\\"password\\": \\"{REDACTED}\\", \\"user\\": \\"ann\\"}}"'),
        ('{\\"api_key\\":\\"hunter2zz\\",\\"n\\":1}', f'{{\\"api_key\\":\\"{REDACTED}\\",\\"n\\":1}}'),
        ("repr: '{\\'token\\': \\'hunter2zz\\'}' sent", f"repr: '{{\\'token\\': \\'{REDACTED}\\'}}' sent"),
        ('{\\\\\\"token\\\\\\": \\\\\\"hunter2zz\\\\\\"} sent', f'{{\\\\\\"token\\\\\\": \\\\\\"{REDACTED}\\\\\\"}} sent'),  # escaped twice
        ('{\\"password\\": {\\"v\\": \\"x}\\", \\"w\\": \\"hunter2zz\\"}, \\"user\\": \\"ann\\"}',
         f'{{\\"password\\": {REDACTED}, \\"user\\": \\"ann\\"}}'),
        ('{\\"password\\": \\"a\\\\\\"hunter2zz\\", \\"user\\": \\"ann\\"}', f'{{\\"password\\": \\"{REDACTED}\\", \\"user\\": \\"ann\\"}}'),
        # An escaped quote inside a quoted value.
        ('password="a\\"hunter2zz" user=ann', f"password={REDACTED} user=ann"),
        ("password='a\\'hunter2zz' user=ann", f"password={REDACTED} user=ann"),
        ('{"password": "a\\"hunter2zz", "user": "ann"}', f'{{"password": "{REDACTED}", "user": "ann"}}'),
        ('cmd="login password=\\"hunter 2zz\\"" user=ann', f'cmd="login password={REDACTED}" user=ann'),
        ('{"password": "hunter2zz', f'{{"password": "{REDACTED}"'),  # cut off: to the end
        # Strings Python joins: every part.
        ('password = "ab" "hunter2zz" user=ann', f"password = {REDACTED} user=ann"),
        ("{'token': 'ab' 'hunter2zz', 'user': 'ann'}", f"{{'token': '{REDACTED}', 'user': 'ann'}}"),
        ("{'token': 'ab'\n          'hunter2zz',\n 'user': 'ann'}", f"{{'token': '{REDACTED}',\n 'user': 'ann'}}"),  # pprint
        ("{'token': 'ab'\n'user': 'ann'}", f"{{'token': '{REDACTED}'\n'user': 'ann'}}"),  # the next name is no part
        # Triple-quoted strings, across lines.
        ('password = """hunter2zz""" user=ann', f"password = {REDACTED} user=ann"),
        ("secret='''x\nhunter2zz''' user=ann", f"secret={REDACTED} user=ann"),
        ("{'token': '''a 'b'\nhunter2zz'''}", f"{{'token': '''{REDACTED}'''}}"),
        ('password: """a\nhunter2zz"""\nuser: ann', f"password: {REDACTED}\nuser: ann"),
        # => separators (Ruby, PHP, Perl) and = after a quoted name (TOML).
        ('{"password" => "hunter2zz", "user" => "ann"}', f'{{"password" => "{REDACTED}", "user" => "ann"}}'),
        ("{:api_key => 'hunter2zz', :user => 'ann'}", f"{{:api_key => {REDACTED}, :user => 'ann'}}"),
        ("password => hunter2zz, user => ann", f"password => {REDACTED}, user => ann"),
        ("['password'=>'hunter2zz', 'user'=>'ann']", f"['password'=>'{REDACTED}', 'user'=>'ann']"),
        ('"api_key" = "hunter2zz"\nuser = "ann"', f'"api_key" = "{REDACTED}"\nuser = "ann"'),
        # INI and TOML sections named secret: their lines, to the next section.
        ("[password]\nvalue = hunter2zz\n\n[db]\nhost = h", f"[password]\n{REDACTED}\n\n[db]\nhost = h"),
        ("[auth]\nuser = u\n\nvalue = hunter2zz\n[db]\nhost = h", f"[auth]\n{REDACTED}\n[db]\nhost = h"),
        ("[[servers.credentials]]\nv = 'hunter2zz'", f"[[servers.credentials]]\n{REDACTED}"),
        # A secret named by a sibling: .NET config, name/value pair objects.
        ('<add key="ApiKey" value="hunter2zz"/><add key="Timeout" value="30"/>',
         f'<add key={REDACTED} value="{REDACTED}"/><add key={REDACTED} value="30"/>'),
        ('<param name="token" type="x" value="hunter2zz"/>', f'<param name="token" type="{REDACTED}" value="{REDACTED}"/>'),
        ('[{"name": "password", "value": "hunter2zz"}, {"name": "user", "value": "ann"}]',
         f'[{{"name": "password", "value": "{REDACTED}"}}, {{"name": "user", "value": "ann"}}]'),
        ('{"value": "hunter2zz", "Name": "DB_PASSWORD"}', f'{{"value": "{REDACTED}", "Name": "DB_PASSWORD"}}'),
        ('{"Name": "api_key", "Value": {"v": "hunter2zz"}, "n": 1}', f'{{"Name": "api_key", "Value": {REDACTED}, "n": {REDACTED}}}'),
        ("{'key': 'token', 'val': 'hunter2zz'}", f"{{'key': '{REDACTED}', 'val': '{REDACTED}'}}"),
        ('{"ParameterKey": "DbPassword", "ParameterValue": "hunter2zz"}', f'{{"ParameterKey": "DbPassword", "ParameterValue": "{REDACTED}"}}'),
        ('{"name": "password", "value": "hunter2zz', f'{{"name": "password", "value": {REDACTED}'),  # cut off
        # A secret element's attributes.
        ('<password value="hunter2zz"/><n>1</n>', f'<password value="{REDACTED}"/><n>1</n>'),
        ("<token v='hunter2zz'>", f"<token v='{REDACTED}'>"),
        ('<ApiKey Value="hunter2zz" xmlns="urn:x"></ApiKey><n>1</n>', f'<ApiKey Value="{REDACTED}" xmlns="urn:x"></ApiKey><n>1</n>'),
        ('<password value="hunter2zz', f'<password value="{REDACTED}'),  # cut off
        # A secret element never closed: to the next tag when that closes another element.
        ("<data><token>hunter2zz</data><user>ann</user>", f"<data><token>{REDACTED}</data><user>ann</user>"),
        ("<token>hunter2zz<v>x</v></data><user>ann</user>", f"<token>{REDACTED}"),  # a child: to the end
        # An element a name or key attribute names secret: its whole content, to its own close tag.
        ('<setting name="ApiKey"><value>hunter2zz</value></setting><n>1</n>', f'<setting name="ApiKey">{REDACTED}</setting><n>1</n>'),
        ('<param name="password">hunter2zz</param><n>1</n>', f'<param name="password">{REDACTED}</param><n>1</n>'),
        ('<entry key="token" type="s">hunter2zz</entry><n>1</n>', f'<entry key={REDACTED} type="{REDACTED}">{REDACTED}</entry><n>1</n>'),
        ('<setting name="ApiKey"><![CDATA[</setting>hunter2zz]]></setting><n>1</n>', f'<setting name="ApiKey">{REDACTED}</setting><n>1</n>'),
        ('<setting name="ApiKey"><setting name="a">b</setting>hunter2zz</setting><n>1</n>',
         f'<setting name="ApiKey">{REDACTED}</setting><n>1</n>'),  # a child of its own name: paired as nested
        ('<setting name="db"><setting name="token">hunter2zz</setting><v>1</v></setting>',
         f'<setting name="db"><setting name="token">{REDACTED}</setting><v>1</v></setting>'),
        ('<setting name="ApiKey"><v>hunter2zz', f'<setting name="ApiKey">{REDACTED}'),  # cut off: to the end
        # Form fields a sibling field names secret: the other values of its ``&``-joined run.
        ("name=password&value=hunter2zz", f"name=password&value={REDACTED}"),
        ("value=hunter2zz&Name=DB_PASSWORD&flag&n=", f"value={REDACTED}&Name=DB_PASSWORD&flag&n="),
        ("key=api_key&val=hunter2zz", f"key={REDACTED}&val={REDACTED}"),
        ("https://h/p?name=token&value=hunter2zz&n=1 page=2", f"https://h/p?name=token&value={REDACTED}&n={REDACTED} page=2"),
        ('{"body": "name=password&value=hunter2zz", "n": 1}', f'{{"body": "name=password&value={REDACTED}", "n": 1}}'),
        ('{\\"body\\": \\"name=password&value=hunter2zz\\"}', f'{{\\"body\\": \\"name=password&value={REDACTED}\\"}}'),
    ],
)
def test_escaped_joined_sectioned_and_sibling_named_secrets_are_hidden_and_the_rest_stays(text, expected):
    assert redact_text(text) == expected


@pytest.mark.parametrize("text", [
    '{"name": "username", "value": "bob"}', '[{"Name": "Timeout", "Value": "30"}]', '{"name": "region", "value": "eu"}',
    "[database]\nhost = h\nport = 5432", "[section]\nvalue = 30", '<item name="colour" value="red"/>',
    '{\\"user\\": \\"bob\\", \\"n\\": \\"a\\\\\\"b\\"}', 'note = "ab" "cd"', "x => y", '<user id="7">ann</user>',
    "see [token] in the docs", "{'a': '''x\ny'''}",
    # Named by an attribute or a field, but no secret name: the content and the values stay.
    '<add name="ConnectionString">Server=db;Database=app</add>', '<setting name="Timeout"><value>30</value></setting>',
    "name=username&value=bob", "name=region&value=eu&n=1", "a=1&b=2 name=password c=3&d=4", "Q&A name=Password",
])
def test_text_that_names_no_secret_keeps_its_values(text):
    assert redact_text(text) == text


def test_a_value_whose_key_names_no_secret_stays_though_the_key_itself_is_hidden():
    # ``key`` is itself a secret name (``?key=AIza...``): the name it gives is hidden, not its sibling.
    assert redact_text('<add key="Timeout" value="30"/>') == f'<add key={REDACTED} value="30"/>'
    assert redact_text('{"key": "region", "value": "eu"}') == f'{{"key": "{REDACTED}", "value": "eu"}}'


def test_a_secret_element_named_by_a_key_attribute_hides_its_content_and_the_key():
    # ``key`` is itself a secret name: its value is hidden as a pair's, with what follows it up to a space.
    shown = redact_text('<entry key="token">hunter2zz</entry><n>1</n>')
    assert "hunter2zz" not in shown and shown.startswith("<entry key=")


def test_an_unclosed_placeholder_in_prose_still_hides_the_rest_of_the_text():
    # Its text could be a cut-off secret running over lines: no end short of the next tag is safe.
    shown = redact_text("expected <token> in header, got Bearer hunter2zz\nretry later")
    assert "hunter2zz" not in shown and shown.startswith("expected <token>")


@pytest.mark.parametrize(("text", "expected"), [
    # A login page in an error: the void element's attributes are hidden, the page after it shown.
    ('<form><input name="password" value="s3cret"><p>Session expired</p></form>',
     '<form><input name="password" value="********"><p>Session expired</p></form>'),
    ('<meta name="csrf-token" content="abc123"><title>Bad gateway</title>',
     '<meta name="csrf-token" content="********"><title>Bad gateway</title>'),
    # An element that holds something is hidden whole, as before.
    ('<param name="password">hunter2</param><param name="user">ann</param>',
     '<param name="password">********</param><param name="user">ann</param>'),
])
def test_an_html_void_element_named_secret_hides_its_attributes_not_the_page_after_it(text, expected):
    assert redact_text(text) == expected


@pytest.mark.parametrize("before", ["'':'", "'a':'", 'note: "unclosed', "x = '"])
def test_a_stray_quote_on_a_line_before_hides_no_sibling_named_object_from_the_scan(before):
    shown = redact_text(before + '\n{"name": "password", "value": "hunter2"}')
    assert "hunter2" not in shown
