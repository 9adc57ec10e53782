/* A small Markdown renderer for model replies: safe by construction.
 *
 * The text is HTML-escaped FIRST, then the few constructs a chat reply uses are turned into tags
 * built here: fenced code blocks, inline code, headings, lists, block quotes, rules, bold,
 * italics and http(s) links. Nothing of the reply's own markup ever reaches innerHTML unescaped,
 * so a reply containing <script> or onerror= shows as text. An unclosed fence (a reply still
 * streaming) renders as a code block up to the end.
 */
(function () {
  "use strict";

  function escapeHtml(s) {
    return String(s)
      .replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  // `t` is already escaped: only tags made here are added
  function inline(t) {
    return t.split(/(`[^`\n]+`)/g).map(function (p) {
      if (p.length > 2 && p[0] === "`" && p[p.length - 1] === "`") {
        return "<code>" + p.slice(1, -1) + "</code>";
      }
      p = p.replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s()<>]+)\)/g,
        '<a href="$2" target="_blank" rel="noopener noreferrer nofollow">$1</a>');
      p = p.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>");
      p = p.replace(/__([^_\n]+)__/g, "<strong>$1</strong>");
      p = p.replace(/(^|[^*\w])\*([^*\s][^*\n]*?)\*(?!\w)/g, "$1<em>$2</em>");
      return p;
    }).join("");
  }

  function render(text) {
    var lines = escapeHtml(text || "").split("\n");
    var out = [];
    var para = [];
    var list = null;           // {tag, items}
    var quote = [];

    function flushPara() {
      if (para.length) out.push("<p>" + para.map(inline).join("<br>") + "</p>");
      para = [];
    }
    function flushList() {
      if (list) {
        out.push("<" + list.tag + ">" + list.items.map(function (i) {
          return "<li>" + inline(i) + "</li>";
        }).join("") + "</" + list.tag + ">");
      }
      list = null;
    }
    function flushQuote() {
      if (quote.length) out.push("<blockquote>" + quote.map(inline).join("<br>") + "</blockquote>");
      quote = [];
    }
    function flush() { flushPara(); flushList(); flushQuote(); }

    for (var i = 0; i < lines.length; i++) {
      var line = lines[i];
      var fence = /^\s*```\s*([\w+#.-]*)\s*$/.exec(line);
      if (fence) {
        flush();
        var code = [];
        i++;
        while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) { code.push(lines[i]); i++; }
        var lang = fence[1];
        out.push('<div class="code"><div class="code-bar"><span>' + (lang || "code") +
          '</span><button type="button" class="copy">copy</button></div><pre><code' +
          (lang ? ' class="lang-' + lang + '"' : "") + ">" + code.join("\n") + "</code></pre></div>");
        continue;
      }
      var m;
      if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) {
        flush();
        var level = Math.min(m[1].length + 2, 6);      // a reply's "#" is a section, not the page's title
        out.push("<h" + level + ">" + inline(m[2]) + "</h" + level + ">");
      } else if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
        flush();
        out.push("<hr>");
      } else if ((m = /^\s*[-*+]\s+(.*)$/.exec(line))) {
        flushPara(); flushQuote();
        if (!list || list.tag !== "ul") { flushList(); list = { tag: "ul", items: [] }; }
        list.items.push(m[1]);
      } else if ((m = /^\s*\d+[.)]\s+(.*)$/.exec(line))) {
        flushPara(); flushQuote();
        if (!list || list.tag !== "ol") { flushList(); list = { tag: "ol", items: [] }; }
        list.items.push(m[1]);
      } else if ((m = /^&gt;\s?(.*)$/.exec(line))) {
        flushPara(); flushList();
        quote.push(m[1]);
      } else if (/^\s*$/.test(line)) {
        flush();
      } else {
        flushList(); flushQuote();
        para.push(line);
      }
    }
    flush();
    return out.join("");
  }

  window.K3Markdown = { render: render, escapeHtml: escapeHtml };
})();
