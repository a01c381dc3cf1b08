// Keyboard triage for the inbox and the request page. A static file, no inline handlers:
// the pages run under a strict Content-Security-Policy.
//
//   a      approve: the first press selects (focuses) the Approve button and shows a hint;
//          a second "a" within 4 s submits the approve form. Any other key, Esc, or the
//          timeout disarms it. Two presses, so a stray key never decides anything.
//   r      focus the reject reason
//   e      focus the first editable parameter
//   j / n  go to the next pending request (its URL is computed by the server and read from
//          a data-next-url attribute; on the inbox it is the first card)
//   ?      show the shortcut help (<dialog id="shortcut-help">)
//
// Nothing here computes or alters what is decided: the action hash is the one the server
// rendered into each form. The params form's fields belong to the approve form, so both
// Approve buttons (and "a a") post what the reviewer typed; the server refuses a plain
// Approve over changed fields. The script only says so beforehand (#approve-edited). The script only guards against double submission — after the
// first submit a form's buttons are disabled and a second submit is dropped; the server
// applies a repeated decision once anyway.
(function () {
  "use strict";

  var ARM_MS = 4000;
  var armedUntil = 0;
  var armTimer = null;

  function $(id) {
    return document.getElementById(id);
  }

  function typing(target) {
    if (!target || !target.tagName) return false;
    var tag = target.tagName.toLowerCase();
    return tag === "input" || tag === "textarea" || tag === "select" || target.isContentEditable;
  }

  function nextUrl() {
    var holder = document.querySelector("[data-next-url]");
    return holder ? holder.getAttribute("data-next-url") : "";
  }

  function disarm() {
    armedUntil = 0;
    if (armTimer) window.clearTimeout(armTimer);
    armTimer = null;
    var hint = $("approve-armed");
    if (hint) hint.hidden = true;
    var button = $("approve-button");
    if (button) button.classList.remove("armed");
  }

  function approveKey() {
    var form = $("approve-form");
    var button = $("approve-button");
    if (!form || !button) return false;
    if (armedUntil && Date.now() < armedUntil) {
      disarm();
      if (form.requestSubmit) form.requestSubmit(button);
      else button.click();
      return true;
    }
    armedUntil = Date.now() + ARM_MS;
    button.classList.add("armed");
    button.focus();
    var hint = $("approve-armed");
    if (hint) hint.hidden = false;
    armTimer = window.setTimeout(disarm, ARM_MS);
    return true;
  }

  function focusFirst(selector) {
    var element = document.querySelector(selector);
    if (!element) return false;
    element.focus();
    if (element.select && element.tagName.toLowerCase() !== "select") element.select();
    return true;
  }

  function showHelp() {
    var dialog = $("shortcut-help");
    if (!dialog) return false;
    if (dialog.open) dialog.close();
    else if (dialog.showModal) dialog.showModal();
    else dialog.setAttribute("open", "");
    return true;
  }

  function onKey(event) {
    if (event.defaultPrevented || event.ctrlKey || event.metaKey || event.altKey) return;
    var dialog = $("shortcut-help");
    if (dialog && dialog.open && event.key !== "?") return; // Esc closes it natively
    if (typing(event.target)) return;
    var key = event.key;
    if (key !== "a") disarm();
    var handled = false;
    if (key === "a") handled = approveKey();
    else if (key === "r") handled = focusFirst("#reject-reason");
    else if (key === "e") handled = focusFirst("#edit-form [name^='param-']:not([disabled])");
    else if (key === "j" || key === "n") {
      var url = nextUrl();
      if (url) {
        window.location.assign(url);
        handled = true;
      }
    } else if (key === "?") handled = showHelp();
    if (handled) event.preventDefault();
  }

  function guardDoubleSubmit(event) {
    var form = event.target;
    if (!form || !form.hasAttribute || !form.hasAttribute("data-decision")) return;
    if (form.getAttribute("data-submitted") === "1") {
      event.preventDefault(); // a double click: the first submission is on its way
      return;
    }
    form.setAttribute("data-submitted", "1");
    // Disable after this event: a submit button disabled before it would drop its value.
    window.setTimeout(function () {
      var buttons = document.querySelectorAll("form[data-decision] button");
      for (var i = 0; i < buttons.length; i++) buttons[i].disabled = true;
    }, 0);
  }

  function changed(field) {
    if (field.type === "checkbox") return field.checked !== field.defaultChecked;
    if (field.tagName.toLowerCase() === "select") {
      for (var i = 0; i < field.options.length; i++) {
        if (field.options[i].selected !== field.options[i].defaultSelected) return true;
      }
      return false;
    }
    return field.value !== field.defaultValue;
  }

  function showEdited() {
    var hint = $("approve-edited");
    if (!hint) return;
    var fields = document.querySelectorAll("[form='approve-form'][name^='param-']");
    var any = false;
    for (var i = 0; i < fields.length; i++) if (changed(fields[i])) any = true;
    hint.hidden = !any;
  }

  document.addEventListener("keydown", onKey);
  document.addEventListener("input", showEdited);
  document.addEventListener("change", showEdited);
  document.addEventListener("submit", guardDoubleSubmit, true);
  // Back/forward cache: a page restored after a submit must be usable again.
  window.addEventListener("pageshow", function (event) {
    if (!event.persisted) return;
    var forms = document.querySelectorAll("form[data-decision]");
    for (var i = 0; i < forms.length; i++) {
      forms[i].removeAttribute("data-submitted");
      var buttons = forms[i].querySelectorAll("button");
      for (var j = 0; j < buttons.length; j++) buttons[j].disabled = false;
    }
  });
})();
