"""decoding/markup.py: HTML and XML translated with the markup kept. Fake translators make every expected output
knowable without a model (upper-casing with the identity alignment; word reversal with the reversed alignment, so
a tag on source word i lands on target word n-1-i; no alignment at all); the markup of the output is checked by
an independent route (a fresh `html.parser` over input and output, and the source's bytes found by position)."""

from __future__ import annotations

import collections
import html
import html.parser
import io
import re
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_transformer.decoding import documents, markup
from jax_transformer.errors import DataError

SEG = documents.Segmenter("en")


# --- fake translators ------------------------------------------------------------------------------------------


def upper(sentences):
    """Each word upper-cased, in place: word i translates to word i."""
    return [(s.upper(), [(i, i) for i in range(len(s.split()))]) for s in sentences]


def reverse(sentences):
    """The words in reverse order, upper-cased: word i translates to word n-1-i."""
    out = []
    for s in sentences:
        words = s.split()
        n = len(words)
        out.append((" ".join(reversed(words)).upper(), [(i, n - 1 - i) for i in range(n)]))
    return out


def unaligned(sentences):
    """Upper-cased, without an alignment (as sampling gives)."""
    return [(s.upper(), None) for s in sentences]


def run(text, translate=upper, **kwargs):
    kwargs.setdefault("segmenter", SEG)
    return markup.translate_markup_text(text, translate, **kwargs)


def bytes_in(data: bytes, translate=upper, block: int = 1 << 16, **kwargs):
    """`read_markup` then `translate_markup`: (the output's bytes, the report)."""
    report = markup.MarkupReport()
    written = []
    chunks = markup.read_markup(io.BytesIO(data), report, block=block)
    markup.translate_markup(chunks, written.append, translate, segmenter=SEG, report=report, **kwargs)
    return markup.write_bytes("".join(written)), report


# --- an independent reading of markup ----------------------------------------------------------------------------


class Recorder(html.parser.HTMLParser):
    """Every tag as written, every comment, declaration and processing instruction, and the raw text of CDATA
    elements (script, style), in order; text events recorded as text (whitespace-only ones as written)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.seen = []

    def handle_starttag(self, tag, attrs):
        self.seen.append(("start", tag, self.get_starttag_text()))

    def handle_startendtag(self, tag, attrs):
        self.seen.append(("startend", tag, self.get_starttag_text()))

    def handle_endtag(self, tag):
        self.seen.append(("end", tag))

    def handle_data(self, data):
        if self.cdata_elem is not None:  # script/style content: as written
            self.seen.append(("cdata", data))
        elif data.strip():
            if self.seen and self.seen[-1][0] == "text":
                return
            self.seen.append(("text",))
        else:
            self.seen.append(("space", data))

    def handle_comment(self, data):
        self.seen.append(("comment", data))

    def handle_decl(self, decl):
        self.seen.append(("decl", decl))

    def handle_pi(self, data):
        self.seen.append(("pi", data))


def recorded(text: str) -> list:
    parser = Recorder()
    parser.feed(text)
    parser.close()
    out = []
    for item in parser.seen:  # adjacent text and spaces merged, as the parser may cut text anywhere
        if item[0] in ("text", "space") and out and out[-1][0] in ("text", "space"):
            out[-1] = ("text",) if "text" in (item[0], out[-1][0]) else ("space", out[-1][1] + item[1])
        else:
            out.append(item)
    return out


def letters(text: str) -> collections.Counter:
    """The letters and digits of the text content (tags left out, references decoded), case folded."""
    parser = html.parser.HTMLParser(convert_charrefs=True)
    found = []
    parser.handle_data = found.append
    parser.feed(text)
    parser.close()
    return collections.Counter(c for c in "".join(found).casefold() if c.isalnum())


def tag_names(text: str) -> list:
    return [(item[0], item[1]) for item in recorded(text) if item[0] in ("start", "end", "startend")]


PAGE = """<!DOCTYPE html>
<html lang="de"><head><meta charset="utf-8"><title>A title here</title>
<style>p > b { color: red }</style></head>
<body class=main>
  <!-- a comment <b>not a tag</b> -->
  <p id='x1' CLASS="Lead" data-n=3>The <B>red</B> dog runs. It is <i>very <em>fast</em></i> &amp; happy&nbsp;!</p>
  <p>Run <code class=c>ls  -l &lt;dir&gt;</code> to list.<br>Next line <a href="x.html?a=1&amp;b=2">here</a>.</p>
  <ul><li>One item<li>Two <b>items</b></ul>


  <pre>  keep   me <b>as</b> I am </pre><script>var a = "<b>" + 1 < 2;</script>
  <p>Say <kbd>Ctrl  C</kbd> or <span translate="no">Foo  Bar</span> or <i class="x notranslate">Baz</i>.</p>
  <textarea>raw  text</textarea>
  <?php echo 1 ?>
</body></html>
"""


def untouched_regions(text: str) -> list[str]:
    """The parts of PAGE that must come back byte for byte, found by pattern."""
    patterns = [
        r"<!DOCTYPE html>\n",
        r"<style>.*?</style>",
        r"<!--.*?-->",
        r"<pre>.*?</pre>",
        r"<script>.*?</script>",
        r"<code class=c>.*?</code>",
        r"<kbd>.*?</kbd>",
        r'<span translate="no">.*?</span>',
        r'<i class="x notranslate">.*?</i>',
        r"<textarea>.*?</textarea>",
        r"<\?php.*?\?>",
        r"<p id='x1' CLASS=\"Lead\" data-n=3>",
        r"</ul>\n\n\n  ",
    ]
    return [re.search(p, text, re.S).group() for p in patterns]


# --- 1. byte-exactness outside the translated text ----------------------------------------------------------------


@pytest.mark.parametrize("translate", [upper, reverse, unaligned])
def test_everything_outside_the_text_comes_back_byte_for_byte(translate):
    out, report = run(PAGE, translate, rules=markup.Rules.html(keep_attributes=True))
    # The same tags as written (quotes, case, attribute order), comments, declarations, CDATA and whitespace runs:
    # in the same order where the words keep theirs; the same ones where the translation reorders them.
    if translate is upper:
        assert recorded(out) == recorded(PAGE)
    else:

        def marks(text):  # the tags and comments, declarations, CDATA
            return sorted(repr(t) for t in recorded(text) if t[0] not in ("text", "space"))

        assert marks(out) == marks(PAGE)
    for region in untouched_regions(PAGE):
        assert out.count(region) == PAGE.count(region), region
    # The text outside the regions is the translation: no lower-case word of the source is left in it.
    text_only = out
    for region in untouched_regions(PAGE):
        text_only = text_only.replace(region, "")
    text_only = re.sub(r"<[^>]*>", " ", text_only)
    assert not [w for w in re.findall(r"[a-z]{3,}", html.unescape(text_only)) if w not in ("amp", "nbsp")]
    assert report.repair_count == 0 and report.blocks == 6


def test_prefix_and_suffix_of_the_page_are_the_source_by_position():
    out, _ = run(PAGE, reverse, target_language=None)
    head = PAGE.index("A title")
    assert out[:head] == PAGE[:head]
    tail = PAGE.index("</textarea>")
    assert out.endswith(PAGE[tail:])


def test_lang_becomes_the_target_code_and_nothing_else_changes_in_the_tag():
    out, _ = run("<html lang=\"de\"><p lang=de xml:lang='de' id=a>x</p></html>", target_language="fr")
    assert out == '<html lang="fr"><p lang="fr" xml:lang=\'fr\' id=a>X</p></html>'
    out, _ = run('<html lang="de"><p>x</p></html>', target_language=None)
    assert out == '<html lang="de"><p>X</p></html>'


# --- 2. placement ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("i", range(5))
def test_a_tag_on_word_i_wraps_target_word_n_minus_1_minus_i(i):
    words = "alpha beta gamma delta epsilon".split()
    source = " ".join(f"<b>{w}</b>" if k == i else w for k, w in enumerate(words))
    out, report = run(f"<p>{source}</p>", reverse)
    target = [w.upper() for w in reversed(words)]
    target[4 - i] = f"<b>{target[4 - i]}</b>"
    assert out == f"<p>{' '.join(target)}</p>"
    assert report.placed == 1 and report.unplaced_count == 0


def test_nested_tags_nest():
    out, report = run("<p>one <i>two <b>three</b> four</i> five</p>", reverse)
    assert out == "<p>FIVE <i>FOUR <b>THREE</b> TWO</i> ONE</p>"
    assert report.placed == 2


def test_siblings_whose_targets_cross_are_reported_and_still_nest():
    def crossing(sentences):  # a b c d -> A B C D with b->2, c->1: <b>a b</b> and <i>c d</i> would cross
        return [(s.upper(), [(0, 0), (1, 2), (2, 1), (3, 3)]) for s in sentences]

    out, report = run("<p><b>a b</b> <i>c d</i></p>", crossing)
    assert out == "<p><b>A B C</b><i> D</i></p>"  # <i> after <b>: they nest (as siblings), no text lost
    assert [(n.column, n.what.split(":")[0]) for n in report.unplaced] == [(4, "<b>"), (15, "<i>")]
    assert report.placed == 0


def test_punctuation_the_tag_left_out_stays_out():
    out, _ = run("<p>The <b>dog</b>.</p>", upper)
    assert out == "<p>THE <b>DOG</b>.</p>"
    out, _ = run("<p>(<i>see</i>) it</p>", upper)
    assert out == "<p>(<i>SEE</i>) IT</p>"


def test_br_between_sentences_lands_between_the_translations():
    out, report = run("<p>One two.<br>Three four.</p>", reverse)
    assert out == "<p>TWO. ONE<br>FOUR. THREE</p>" and report.sentences == 2


def test_opaque_code_replaces_the_words_aligned_to_its_words():
    out, report = run("<p>Run <code>ls -l</code> now</p>", reverse)
    assert out == "<p>NOW <code>ls -l</code> RUN</p>"
    assert report.placed == 1


def test_without_an_alignment_tags_wrap_the_sentence_and_the_report_counts_it():
    out, report = run("<p>A <b>big</b> dog. It <i>runs</i>.</p>", unaligned)
    assert out == "<p><b>A BIG DOG.</b> <i>IT RUNS.</i></p>"
    assert report.unaligned == 2 and report.placed == 0
    assert "2 sentences without an alignment" in report.describe()


# --- 3. each block's text is translated as translate --document translates it ----------------------------------------


@pytest.mark.parametrize("translate", [upper, reverse])
def test_each_blocks_text_is_the_document_translation_of_its_text(translate):
    blocks = [
        "The <b>red</b> dog runs.  It is <i>very <em>fast</em></i> &amp; happy!\n  Really.",
        "Run <a href='x'>this</a> now.\tThen <b>that</b>?",
        "One.",
    ]
    page = "<div>" + "".join(f"<p>{b}</p>\n" for b in blocks) + "</div>"
    out, _ = run(page, translate)
    got = re.findall(r"<p>(.*?)</p>", out, re.S)
    for source, target in zip(blocks, got, strict=True):
        text = html.unescape(re.sub(r"<[^>]*>", "", source))
        pieces, at = [], 0  # cut as one line (line breaks read as spaces), separators written as they were
        for piece in SEG.split(text.replace("\n", " ")):
            pieces.append(piece._replace(text=text[at : at + len(piece.text)]))
            at += len(piece.text)
        expected = documents.joined(pieces, [t for t, _ in translate([p.text for p in pieces if p.sentence])])
        assert html.unescape(re.sub(r"<[^>]*>", "", target)) == expected


# --- 4. attributes ---------------------------------------------------------------------------------------------


def test_attributes_translated_with_their_quotes_kept():
    page = """<img alt="A dog" src=dog.png title='The "best" dog'><input placeholder=name><a title="x">y</a>"""
    out, report = run(page, upper)
    assert out == (
        """<img alt="A DOG" src=dog.png title='THE "BEST" DOG'><input placeholder="NAME"><a title="X">Y</a>"""
    )
    assert report.attributes == 4


def test_attribute_values_are_escaped_for_their_quotes():
    def noisy(sentences):
        return [(s + " & 'q' \"r\" <", None) for s in sentences]

    out, _ = run("""<img alt='a' title="b" placeholder=c>""", noisy)
    assert out == (
        "<img alt='a &amp; &#x27;q&#x27; \"r\" &lt;' title=\"b &amp; 'q' &quot;r&quot; &lt;\" "
        "placeholder=\"c &amp; 'q' &quot;r&quot; &lt;\">"
    )
    # An independent parser reads back the values the translator gave.
    parser = html.parser.HTMLParser()
    got = []
    parser.handle_startendtag = parser.handle_starttag = lambda tag, attrs: got.extend(attrs)
    parser.feed(out)
    assert got == [("alt", "a & 'q' \"r\" <"), ("title", "b & 'q' \"r\" <"), ("placeholder", "c & 'q' \"r\" <")]


def test_unquoted_value_that_gets_spaces_gets_quotes():
    out, _ = run("<img alt=dog src=x>", lambda ss: [("le " + s, None) for s in ss])
    assert out == '<img alt="le dog" src=x>'


def test_keep_attributes_leaves_them_and_others_are_byte_identical():
    page = """<img ALT="A dog" src = 'x.png' data-x="a &amp; b" title=t>"""
    out, report = run(page, upper, rules=markup.Rules.html(keep_attributes=True))
    assert out == page and report.attributes == 0
    out, _ = run(page, upper)
    assert out == """<img ALT="A DOG" src = 'x.png' data-x="a &amp; b" title="T">"""


# --- 5. malformed HTML -----------------------------------------------------------------------------------------


def notes(report) -> list[tuple[int, int]]:
    return [(n.line, n.column) for n in report.repairs]


def test_unclosed_inline_tag_is_reported_and_the_text_translated_in_parts():
    out, report = run("<p>A <b>dog runs.</p>\n<p>Next.</p>", upper)
    assert out == "<p>A <b>DOG RUNS.</p>\n<p>NEXT.</p>"
    assert notes(report) == [(1, 6)] and "<b> not closed" in report.repairs[0].what


def test_stray_end_tag_is_kept_and_reported():
    out, report = run("<p>stray </i> end</p>\n</div>", reverse)
    assert out == "<p>STRAY </i> END</p>\n</div>"
    assert notes(report) == [(1, 10), (2, 1)]
    assert all("closes no open element" in n.what for n in report.repairs)


def test_misnested_tags_are_cut_and_reported():
    out, report = run("<p><b><i>x y</b></i> z</p>", reverse)
    assert tag_names(out) == tag_names("<p><b><i>x y</b></i> z</p>")
    assert re.sub(r"<[^>]*>", "", out) == "Y X Z"
    assert notes(report) == [(1, 7), (1, 17)]
    assert "misnested" in report.repairs[0].what


def test_stray_less_than_is_text_and_reported_where_it_is():
    out, report = run("<p>a b\n c < d</p>", upper)
    assert out == "<p>A B  C &lt; D</p>"  # a line break inside a sentence is read as a space
    assert notes(report) == [(2, 4)] and "'<'" in report.repairs[0].what


def test_empty_end_tag_is_kept_and_reported():
    out, report = run("<p>one two </> three</p>", reverse)
    assert out.count("</>") == 1 and tag_names(out) == [("start", "p"), ("end", "p")]
    assert sorted(re.sub(r"<[^>]*>|</>", " ", out).split()) == ["ONE", "THREE", "TWO"]
    assert notes(report) == [(1, 12)] and "</>" in report.repairs[0].what


def test_bytes_not_utf8_are_kept_outside_text_and_reported_with_their_column():
    data = b"<p title='t\xff'>caf\xe9 ok.</p>\n<!-- \xfe -->\n<p>x\xc3</p>"
    out, report = bytes_in(data, upper, rules=markup.Rules.html(keep_attributes=True))
    assert out == b"<p title='t\xff'>CAF\xef\xbf\xbd OK.</p>\n<!-- \xfe -->\n<p>X\xef\xbf\xbd</p>"
    assert notes(report) == [(1, 12), (1, 18), (2, 6), (3, 5)]
    for block in (1, 3, 7):  # the same places whatever the reads
        assert bytes_in(data, upper, block=block, rules=markup.Rules.html(keep_attributes=True)) == (out, report)


@pytest.mark.parametrize("element", ["script", "style", "pre", "textarea"])
def test_untouched_element_not_closed_runs_to_the_end(element):
    page = f"<p>a b</p>\n<{element}>x < y <b>z</b>\n"
    out, report = run(page, reverse)
    assert out == page.replace("a b", "B A")
    assert notes(report)[-1] == (2, 1) and f"<{element}> not closed" in report.repairs[-1].what


def test_opaque_element_not_closed_runs_to_the_end():
    out, report = run("<p>run <code>ls -l\n<b>x</b>", reverse)
    assert out == "<p>RUN <code>ls -l\n<b>x</b>"  # the text before it translated alone: nothing goes inside it
    assert notes(report) == [(1, 8)] and "<code> not closed" in report.repairs[0].what


# --- 6. limits and encodings -----------------------------------------------------------------------------------


def test_nesting_deeper_than_the_limit_names_it():
    rules = markup.Rules.html(max_depth=8)
    run("<div>" * 8 + "x", upper, rules=rules)
    with pytest.raises(DataError, match=r"input, line 2, column 27: <span> is nested 9 elements deep, over the "
                                        r"limit of 8"):  # fmt: skip
        run("<div>" * 4 + "\n  " + "<span>" * 5 + "x", upper, rules=rules)


def test_attribute_longer_than_the_limit_names_it():
    rules = markup.Rules.html(max_attribute=10)
    run('<img alt="0123456789">', upper, rules=rules)
    with pytest.raises(DataError, match=r"line 1, column 4: attribute 'alt' of <img> has 11 characters, over the "
                                        r"limit of 10"):  # fmt: skip
        run('<p><img alt="0123456789A">', upper, rules=rules)


def test_document_longer_than_max_bytes_names_the_limit_and_place():
    report = markup.MarkupReport(origin="doc.html")
    data = b"<p>one</p>\n<p>two</p>\n"
    assert "".join(markup.read_markup(io.BytesIO(data), report, block=5, max_bytes=len(data))) == data.decode()
    with pytest.raises(DataError, match=r"doc.html, line 2, column 4: longer than the limit of 14 bytes"):
        list(markup.read_markup(io.BytesIO(data), report, block=5, max_bytes=14))


@pytest.mark.parametrize(
    "data, named",
    [
        ("\ufeff<p>x</p>".encode("utf-16"), "UTF-16"),
        (b'<html><head>\n<meta charset="iso-8859-1"></head>', "line 2: a <meta charset> names the encoding iso-8859-1"),
        (b'<meta http-equiv="Content-Type" content="text/html; charset=windows-1252">', "windows-1252"),
        (b'<?xml version="1.0" encoding="ISO-8859-1"?>\n<a/>', "the XML declaration names the encoding ISO-8859-1"),
        (b'\xef\xbb\xbf<?xml version="1.0" encoding="latin-1"?><a/>', "encoding latin-1"),
    ],
)
def test_another_encoding_is_a_data_error_naming_it(data, named):
    with pytest.raises(DataError, match=re.escape(named)):
        list(markup.read_markup(io.BytesIO(data), markup.MarkupReport()))


def test_utf8_bom_is_kept_byte_for_byte_and_not_translated():
    asked = []

    def spy(sentences):
        asked.extend(sentences)
        return upper(sentences)

    out, report = bytes_in(b"\xef\xbb\xbf<!DOCTYPE html>\n<p>x</p>", spy)
    assert out == b"\xef\xbb\xbf<!DOCTYPE html>\n<p>X</p>" and asked == ["x"]
    out, _ = bytes_in(b"\xef\xbb\xbfHello there.", spy)
    assert out == b"\xef\xbb\xbfHELLO THERE." and asked[-1] == "Hello there."


# --- 7. XML ----------------------------------------------------------------------------------------------------

XLIFF = """<?xml version="1.0" encoding="UTF-8"?>
<xliff version="1.2"><file source-language="en" target-language="fr"><body>
<trans-unit id="1"><source xml:lang="en">Press <g id="1">the red</g> button<x id="2"/> now.</source></trans-unit>
<trans-unit id="2"><source>Keep <ph id="3">{0} &amp; {1}</ph> this <bpt id="4">&lt;b&gt;</bpt>one<ept id="4">\
&lt;/b&gt;</ept>.</source></trans-unit>
</body></file></xliff>
"""


def test_xliff_inline_elements_are_placed_and_ph_is_opaque():
    out, report = run(XLIFF, reverse, rules=markup.Rules.xml_rules(), target_language="fr")
    # The translation reverses the words; the tags keep the source's sequence: <x/> follows <g>, as it did.
    assert '<source xml:lang="fr">NOW. BUTTON <g id="1">RED THE</g><x id="2"/> PRESS</source>' in out
    assert out.startswith(XLIFF[: XLIFF.index('xml:lang="en"')])
    assert out.endswith(XLIFF[XLIFF.index("</source></trans-unit>\n</body>") :])
    assert tag_names(out) == tag_names(XLIFF)
    # bpt and ept inside a word: both carried whole, in their order after <ph>, the word's own text kept.
    assert (
        '<source>&lt;B&gt;ONE&lt;/B&gt;. THIS <ph id="3">{0} &amp; {1}</ph><bpt id="4">&lt;b&gt;</bpt>'
        '<ept id="4">&lt;/b&gt;</ept> KEEP</source>'
    ) in out
    assert sum("part of a word" in n.what for n in report.unplaced) == 2
    assert sum("as in the source" in n.what for n in report.unplaced) == 1  # the <x/>
    assert report.kind == "xml" and report.sentences == 2 and report.repair_count == 0 and report.placed == 2


def test_xml_inline_elements_given():
    page = "<doc><p>Hello <term>big</term> world.</p><note>a <bold>b</bold></note><code>x</code></doc>"
    out, _ = run(page, reverse, rules=markup.Rules.xml_rules(inline=["term", "bold"], opaque=["code"]))
    assert out == "<doc><p>WORLD. <term>BIG</term> HELLO</p><note><bold>B</bold> A</note><code>x</code></doc>"
    # Without them they are blocks.
    out, _ = run(page, reverse, rules=markup.Rules.xml_rules(inline=[], opaque=[]))
    assert out == "<doc><p>HELLO <term>BIG</term> WORLD.</p><note>A <bold>B</bold></note><code>X</code></doc>"


def test_xml_has_no_raw_text_elements():
    page = "<doc><script>a <b>b</b></script></doc>"
    out, _ = run(page, reverse, rules=markup.Rules.xml_rules(inline=["b"]))
    assert out == "<doc><script><b>B</b> A</script></doc>"


# --- 8. streaming ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 7, 4096])
@pytest.mark.parametrize("chunk_sentences", [1, 2048])
def test_chunks_give_the_whole_documents_output(size, chunk_sentences):
    whole, whole_report = run(PAGE + XLIFF[40:], reverse, target_language="en")
    written = []
    text = PAGE + XLIFF[40:]
    report = markup.translate_markup(
        [text[i : i + size] for i in range(0, len(text), size)],
        written.append,
        reverse,
        segmenter=SEG,
        target_language="en",
        chunk_sentences=chunk_sentences,
    )
    assert "".join(written) == whole and report.to_dict() == whole_report.to_dict()


def test_many_blocks_are_written_as_they_go():
    written = []
    calls = []

    def counting(sentences):
        calls.append(len(sentences))
        return upper(sentences)

    page = "".join(f"<p>Sentence number {i}.</p>\n" for i in range(50))
    markup.translate_markup([page[i : i + 64] for i in range(0, len(page), 64)], written.append, counting,
                            segmenter=SEG, chunk_sentences=8)  # fmt: skip
    assert len(written) > 3 and max(calls) <= 9
    assert "".join(written) == page.replace("Sentence number", "SENTENCE NUMBER")


def test_prepared_gives_the_same_text_as_the_stream():
    page = "<p>A <b>red</b> dog.</p><img alt='Nice dog'>"
    prepared = markup.Prepared(page, segmenter=SEG, target_language="fr")
    assert prepared.sentences == ["A red dog.", "Nice dog"]
    assert prepared.render(reverse(prepared.sentences)) == run(page, reverse, target_language="fr")[0]
    assert prepared.report.placed == 1


# --- 9. any tree of tags and text ------------------------------------------------------------------------------

_WORDS = st.sampled_from(["dog", "Cat", "runs", "a", "b.", "end.", "&amp;", "&lt;", "&#169;", "&", "<", " ", "  ",
                          "\n", "x,", "Yes!", "&nbsp;", "é"])  # fmt: skip
_TEXT = st.lists(_WORDS, max_size=6).map(lambda ws: " ".join(ws))


def _element(children):
    inline = st.sampled_from(["b", "i", "em", "a href=x", "span title='t t'", "SPAN", "sub"])
    block = st.sampled_from(["p", "div", "li", "h1"])
    opaque = st.sampled_from(["code", "kbd", "span translate=no"])
    untouched = st.sampled_from(["pre", "script", "style", "textarea"])
    void = st.sampled_from(["br", "img alt='A dog'", "wbr", "hr"])

    def wrap(tag, kids):
        name = tag.split()[0]
        return f"<{tag}>{''.join(kids)}</{name}>"

    return st.one_of(
        st.tuples(inline, st.lists(children, max_size=3)).map(lambda t: wrap(*t)),
        st.tuples(block, st.lists(children, max_size=3)).map(lambda t: wrap(*t)),
        st.tuples(opaque, _TEXT).map(lambda t: wrap(t[0], [html.escape(t[1], quote=False)])),
        st.tuples(untouched, _TEXT).map(lambda t: wrap(t[0], [t[1].replace("<", "")])),
        void.map(lambda t: f"<{t}>"),
        st.just("<!-- note -->"),
    )


_TREE = st.recursive(_TEXT, lambda kids: _element(kids), max_leaves=12).map(lambda x: x if isinstance(x, str) else x)
_DOC = st.lists(_TREE, max_size=4).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_DOC, st.sampled_from([upper, reverse, unaligned]))
def test_any_tree_comes_back_with_its_tags(page, translate):
    out, _ = run(page, translate, rules=markup.Rules.html(keep_attributes=True))
    rules = markup.Rules.html()
    inline = rules.inline | rules.opaque

    def outer(text):  # tags as written outside the inline ones, and what untouched elements hold, in order
        return [t for t in recorded(text) if t[0] not in ("text", "space") and t[1] not in inline]

    assert outer(out) == outer(page)  # a block's inline tags move with its words; every other tag stays
    assert not letters(page) - letters(out)  # no text lost (opaque text may come twice, without an alignment)
    assert sorted(map(repr, recorded(out))) == sorted(map(repr, recorded(page))) or (
        sorted(tag_names(out)) == sorted(tag_names(page))
    )
    if translate is not unaligned:  # with an alignment, in the input's sequence (without, tags nest in the sentence)
        assert tag_names(out) == tag_names(page)


# --- 10. a real model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from tests.helpers.saved import saved_run

    return saved_run(tmp_path_factory.mktemp("markup") / "run")


@pytest.mark.slow  # a model decodes every block twice, and once more through the command line
def test_a_real_model_translates_each_block_as_a_document(run_dir, tmp_path):
    from jax_transformer import Translator
    from jax_transformer.cli import main as cli

    translator = Translator(run_dir, "latest", beam_size=1)
    blocks = ["one hundred and <b>two</b>", "one hundred <i>and</i> three", "<a href=x>one hundred</a> and eleven"]
    page = "<html><body>\n" + "".join(f"<p>{b}</p>\n" for b in blocks) + "<pre>one</pre></body></html>\n"
    report = markup.MarkupReport()
    out = translator.translate_markup(page, report=report)
    got = re.findall(r"<p>(.*?)</p>", out)
    for source, target in zip(blocks, got, strict=True):
        expected = translator.translate_document(re.sub(r"<[^>]*>", "", source))
        assert html.unescape(re.sub(r"<[^>]*>", "", target)) == expected
    assert out.endswith("<pre>one</pre></body></html>\n") and report.sentences == 3
    path = tmp_path / "page.html"
    path.write_text(page, encoding="utf-8")
    stdout, stderr = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = stdout, stderr
    try:
        code = cli.main(["translate", "--checkpoint", str(run_dir), "--beam-size", "1", "--input-format", "html",
                         "--input", str(path)])  # fmt: skip
    finally:
        sys.stdout, sys.stderr = saved
    stdout.flush()
    assert code == 0, stderr.getvalue()
    report.origin = str(path)  # the command line names its input in the report
    assert stdout.buffer.getvalue() == out.encode("utf-8") and report.describe() in stderr.getvalue()


_FRAGMENTS = st.sampled_from(["<b>", "</b>", "<i>", "</i>", "<p>", "</p>", "<div>", "</div>", "</>", "< ", "&", "&amp",
                              "<code>", "</code>", "<script>", "</script>", "<!-- c -->", "<br>", "<img alt='x y'>",
                              "<a title=t>", "</a>", "dog", " runs", ". ", "\n", "Cat", "<li>", "<pre>", "</pre>",
                              "<span translate=no>", "</span>", "<ul>", "</ul>", "é"])  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_FRAGMENTS, max_size=24).map("".join), st.sampled_from([upper, reverse, unaligned]))
def test_any_malformed_fragments_come_back_with_their_tags(page, translate):
    out, report = run(page, translate, rules=markup.Rules.html(keep_attributes=True))
    assert sorted(tag_names(out)) == sorted(tag_names(page))
    if translate is not unaligned:
        assert tag_names(out) == tag_names(page)
    assert not letters(page) - letters(out)
    assert out.count("</>") == page.count("</>") and out.count("<!-- c -->") == page.count("<!-- c -->")
    assert report.repair_count >= ("</>" in page and not re.search("<(code|script|pre|span)", page))


# --- found by the tests above: each a case that failed before markup.py was fixed ------------------------------------


def test_an_escaped_less_than_is_no_repair():
    out, report = run("<p>A &lt;b&gt; tag.</p>", upper)
    assert out == "<p>A &lt;B&gt; TAG.</p>" and report.repair_count == 0


def test_empty_end_tag_with_nothing_before_it_is_kept():
    out, report = run("</>", upper)
    assert out == "</>" and notes(report) == [(1, 1)]


@pytest.mark.parametrize("translate", [upper, reverse])
def test_an_empty_tag_beside_opaque_content_is_kept(translate):
    out, _ = run("<p>x <code>a b</code><b></b> y</p>", translate)
    assert "<code>a b</code><b></b>" in out
    out, _ = run("<code>dog dog</code><b></b>&amp;", upper)
    assert out == "<code>dog dog</code><b></b>&amp;"


def test_opaque_part_of_a_word_keeps_the_words_translation():
    out, report = run("<p>call <code>f</code>(x) now</p>", reverse)
    assert out == "<p>NOW <code>f</code>F(X) CALL</p>"  # the translation of "f(x)" kept, the code put before it
    assert report.unplaced_count == 1 and "part of a word" in report.unplaced[0].what


def test_a_translator_that_loses_sentences_is_named():
    with pytest.raises(ValueError, match="gave 1 translations of 2 sentences"):
        run("<p>One.</p><p>Two.</p>", lambda sentences: upper(sentences[:1]), chunk_sentences=4)


def test_pairs_out_of_range_are_left_out():
    out, report = run("<p>a <b>b</b></p>", lambda ss: [(s.upper(), [(-1, 0), (1, -1), (1, 7), (1, 0)]) for s in ss])
    assert out == "<p><b>A</b> B</p>" and report.placed == 1


def test_line_starts_are_forgotten_as_the_stream_goes():
    page = "".join(f"<p>Line <b>{i}</b>.</p>\n" for i in range(4500)) + "<p>x\n<b>y</b> &lt\n <i>z</p>"
    written = []
    report = markup.translate_markup([page[i : i + 100] for i in range(0, len(page), 100)], written.append, reverse,
                                     segmenter=SEG)  # fmt: skip
    assert "".join(written) == run(page, reverse)[0]
    assert notes(report) == [(4503, 2)]  # the <i> not closed: its place counted through every line


def test_attributes_of_untranslated_elements_are_left_and_not_sent():
    asked = []

    def spy(sentences):
        asked.extend(sentences)
        return upper(sentences)

    page = (
        '<textarea placeholder="Type here">x</textarea><div translate=no title="A tip">y</div>'
        '<p>z <img translate=no alt="A dog"> <input class="notranslate" placeholder="Name" lang=de> '
        '<code title="A code">c</code></p><pre lang=de>w</pre>'
    )
    out, report = run(page, spy, target_language="fr")
    assert out == page.replace(">z <", ">Z <")
    assert asked == ["z"] and report.attributes == 0  # <input> ends the block; the code alone is no sentence


def test_attribute_limit_holds_in_untranslated_elements_too():
    rules = markup.Rules.html(max_attribute=4)
    for page in ['<pre title="12345">', '<p><code class="12345">x</code></p>', '<img translate=no alt="12345">']:
        with pytest.raises(DataError, match="over the limit of 4"):
            run(page, upper, rules=rules)


def test_inline_and_opaque_elements_flags_give_the_xml_rules():
    from jax_transformer.cli.main import build_parser
    from jax_transformer.decoding.translator import Translator

    args = build_parser().parse_args(["translate", "--checkpoint", "none", "--input-format", "xml", "--inline-elements",
                                      "term,Bold", "--opaque-elements", "var"])  # fmt: skip
    assert Translator.markup_rules(None, True, False).attributes == frozenset()  # XML's attributes left, always
    rules = Translator.markup_rules(None, True, True, args.inline_elements, args.opaque_elements)
    page = "<doc><p>Hello <term>big</term> <var>x y</var> world.</p><note>a <bold>b</bold></note><g>c</g></doc>"
    out, _ = run(page, reverse, rules=rules)
    # Reversed, <var> would come first; it follows <term> as in the source, and takes the words it replaced along.
    assert out == ("<doc><p>WORLD. <term>BIG</term><var>x y</var> HELLO</p><note><bold>B</bold> A</note><g>C</g></doc>")


def test_without_an_alignment_sibling_tags_nest_and_opaque_content_goes_beside():
    out, report = run("<p><b>a</b> b <i>c</i>.</p>", unaligned)
    assert out == "<p><b><i>A B C.</i></b></p>" and report.unplaced_count == 0 and report.unaligned == 1
    out, _ = run("<p>Run <code>ls</code> now.</p>", unaligned)
    assert out == "<p>RUN LS NOW.<code>ls</code></p>"  # never in place of the translation
    out, _ = run("<p>dog<code> </code></p>", upper)
    assert out == "<p>DOG<code> </code></p>"  # the code's space is not the sentence's


def test_tags_on_the_same_words_keep_their_order_and_each_is_counted_once():
    def first(sentences):  # every word translates to the first
        return [(s.upper(), [(i, 0) for i in range(len(s.split()))]) for s in sentences]

    out, report = run("<p><b>a</b> <i>b</i> <u>c</u></p>", first)
    assert out == "<p><b>A</b><i></i><u></u> B C</p>"  # the input's sequence of tags; the later two reported
    assert (report.placed, report.unplaced_count) == (1, 2)
    assert [n.column for n in report.unplaced] == [13, 22]


def test_report_lists_the_first_notes_and_counts_all(tmp_path):
    page = "".join(f"<p>x{i} </i></p>\n" for i in range(markup.MAX_NOTES + 5))
    _, report = run(page, upper)
    assert report.repair_count == markup.MAX_NOTES + 5 and len(report.repairs) == markup.MAX_NOTES
    assert report.describe().endswith(", ...)") and report.to_dict()["repairs"][1] == (
        "line 2, column 7: </i> closes no open element: kept as it is"
    )
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'none.html'}: cannot read")):
        list(markup.read_markup(tmp_path / "none.html", markup.MarkupReport()))


def test_tokenizer_words_map_to_the_texts_words():
    # As many words both ways (SentencePiece: a word at each space, an unknown character's too): word for word.
    assert markup._to_spaces([5, 5], "Hello *") == [0, 1]
    # Fewer words in the text (a tokenizer that splits off a mark): by letters.
    assert markup._to_spaces([3, 1, 2], "dog. at") == [0, 0, 1]
    assert markup._to_spaces([3, 1, 1], "dogs at") is None  # letters that do not add up: no alignment


def test_bytes_not_utf8_never_reach_the_splitter_or_the_model():
    # A model's `fits` encodes the text (sentencepiece cannot take a lone surrogate, nor can UTF-8).
    strict = documents.Segmenter("en", fits=lambda sentence: len(sentence.encode("utf-8")) < 10_000)
    seen = []

    def spy(sentences):
        seen.extend(sentences)
        return upper(sentences)

    report = markup.MarkupReport()
    data = b'<p>Bad \xff byte here. Next one.</p><img alt="an \xfe alt">'
    written = []
    markup.translate_markup(markup.read_markup(io.BytesIO(data), report), written.append, spy, segmenter=strict,
                            report=report)  # fmt: skip
    out = markup.write_bytes("".join(written))
    assert seen == ["Bad \ufffd byte here.", "Next one.", "an \ufffd alt"]
    assert out == b'<p>BAD \xef\xbf\xbd BYTE HERE. NEXT ONE.</p><img alt="AN \xef\xbf\xbd ALT">'
    assert report.repair_count == 2


def test_markup_without_sentences_is_written_as_it_goes():
    calls = []
    page = "<hr>\n" * 1000 + "<p>end.</p>"
    report = markup.translate_markup([page], calls.append, upper, segmenter=SEG, pending_chars=1000)
    assert len(calls) >= 5 and "".join(calls) == page.replace("end.", "END.") and report.sentences == 1
