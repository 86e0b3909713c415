/* Course decks: make every slide fit the reveal.js canvas, then start reveal.js.
 *
 * tools/classroom.py builds one deck per notebook with nbconvert; its slides follow the cells'
 * slide metadata, written for a notebook, not for a 1280 x 720 canvas. Left alone, long code lines
 * are clipped on the right and tall slides run off the bottom (nbconvert's "scroll" option makes
 * them scroll, but a presenter cannot scroll while talking, and a fragment that appears below the
 * fold is never seen). So, before reveal.js starts (and lays out, numbers and links the slides):
 *
 *  1. Width. A <pre> (code or printed output) whose longest line does not fit gets a smaller
 *     font, down to MIN_CODE_PX; lines that still do not fit wrap. Nothing is cut off.
 *  2. Height. A slide at most 1/MIN_SHRINK times too tall is shrunk to fit (text stays >= 85%).
 *     A taller one is split between cells: the rest moves to a new vertical slide headed
 *     "<title> (continued)", whose first cell shows at once. A slide without a heading whose
 *     first cell is a caption of what follows ("Two plans as timelines: ...") would keep that
 *     caption alone and send its picture on under "(continued)"; it is shrunk further instead,
 *     down to CAPTION_SHRINK, before it is split. The decks navigate linearly, so a
 *     presenter keeps pressing "next" and never scrolls; the room always sees the whole slide.
 *  3. One cell taller than the canvas on its own is shrunk down to MIN_ZOOM, and beyond that
 *     scrolls inside its slide, each fragment scrolled into view as it appears.
 *
 * The split happens before reveal.js starts, so slide numbers, the overview (Esc) and URLs
 * (#/3/2) all see the final slides. Content that renders late (widget snapshots, MathJax) is
 * waited for; if a slide still grows after the start, step 3 applies to it when it is shown.
 */
(function () {
  "use strict";

  var MIN_CODE_PX = 13;     // the smallest code font (the slides' code font is 19px)
  var MIN_SHRINK = 0.85;    // shrink a whole slide at most this far before splitting it
  var CAPTION_SHRINK = 0.75; // ... or this far, to keep a slide's caption with what it captions
  var MIN_ZOOM = 0.6;       // shrink one oversized cell at most this far before it scrolls
  var SETTLE_MS = 400;      // no DOM change for this long: widgets and MathJax are done
  var MAX_WAIT_MS = 5000;   // start anyway after this long

  function leafSlides(root) {
    return Array.prototype.filter.call(root.querySelectorAll("section"), function (section) {
      return !section.querySelector("section");
    });
  }

  // Run fn with `section` laid out, as reveal.js hides the slides it does not show.
  function laidOut(section, fn) {
    var chain = [section];
    if (section.parentElement && section.parentElement.tagName === "SECTION") {
      chain.push(section.parentElement);
    }
    var saved = chain.map(function (element) {
      var state = [element.style.display, element.hasAttribute("hidden")];
      element.style.display = "block";
      element.removeAttribute("hidden");
      return state;
    });
    try {
      return fn();
    } finally {
      chain.forEach(function (element, index) {
        element.style.display = saved[index][0];
        if (saved[index][1]) element.setAttribute("hidden", "");
      });
    }
  }

  function overflowsRight(pre) {
    return pre.scrollWidth > pre.clientWidth + 1;
  }

  // 1. Width: shrink the font of each too-wide <pre>, then wrap what still does not fit.
  function fitWidths(section) {
    Array.prototype.forEach.call(section.querySelectorAll("pre"), function (pre) {
      if (pre.clientWidth === 0 || !overflowsRight(pre)) return;
      var size = parseFloat(window.getComputedStyle(pre).fontSize);
      // Monospace text is as wide as its font is large: one step to about the right size.
      var target = Math.max(MIN_CODE_PX, Math.floor(size * pre.clientWidth / pre.scrollWidth * 2) / 2);
      pre.style.fontSize = target + "px";
      while (overflowsRight(pre) && target > MIN_CODE_PX) {
        target -= 0.5;
        pre.style.fontSize = target + "px";
      }
      if (overflowsRight(pre)) pre.classList.add("course-wrap");
    });
  }

  function bottomLimit(section, height) {
    return height - parseFloat(window.getComputedStyle(section).paddingBottom);
  }

  // The parts a slide can be split between: its top-level cells and fragments, and the cells
  // inside a fragment (which gets split in two).
  function parts(section) {
    var found = [];
    Array.prototype.forEach.call(section.children, function (child) {
      if (child.tagName === "ASIDE" || child.tagName === "SCRIPT" ||
          child.classList.contains("course-continued-label")) return;
      if (child.classList.contains("fragment") && child.children.length > 1) {
        Array.prototype.forEach.call(child.children, function (cell) { found.push(cell); });
      } else {
        found.push(child);
      }
    });
    return found;
  }

  function bottomOf(element, section) {
    var top = 0;
    for (var node = element; node && node !== section; node = node.offsetParent) top += node.offsetTop;
    return top + element.offsetHeight;
  }

  function titleOf(section) {
    var label = section.querySelector(".course-continued-label");
    if (label) return label.dataset.title;
    var heading = section.querySelector("h1, h2, h3, h4");
    return heading ? heading.textContent.replace(/\u00b6/g, "").trim() : "";
  }

  // 2. Split `section` before its first part that ends below the canvas (after it, when that is
  // the first part); return the new slide, or null when the slide is that one part.
  function split(section, height) {
    var limit = bottomLimit(section, height);
    var all = parts(section);
    var cut = -1;
    for (var i = 0; i < all.length; i++) {
      if (bottomOf(all[i], section) > limit) { cut = Math.max(i, 1); break; }
    }
    if (cut < 1 || cut >= all.length) return null;
    var first = all[cut];
    if (first.parentElement !== section) {
      // Inside a fragment: its later cells form a second fragment that moves on.
      var fragment = first.parentElement;
      var rest = fragment.cloneNode(false);
      while (first.nextSibling) rest.appendChild(first.nextSibling);
      rest.insertBefore(first, rest.firstChild);
      fragment.parentElement.insertBefore(rest, fragment.nextSibling);
      first = rest;
    }
    var next = document.createElement("section");
    next.className = "course-continued";
    var title = titleOf(section);
    var label = document.createElement("p");
    label.className = "course-continued-label";
    label.dataset.title = title;
    label.textContent = (title ? title + " " : "") + "(continued)";
    next.appendChild(label);
    for (var node = first; node;) {
      var following = node.nextSibling;
      if (!(node.tagName === "ASIDE")) next.appendChild(node);   // speaker notes stay with the first part
      node = following;
    }
    first.classList.remove("fragment");   // it is why the slide was cut: show it at once
    section.parentElement.insertBefore(next, section.nextSibling);
    return next;
  }

  function shrinkWrapper(section) {
    var wrapper = section.querySelector(":scope > .course-shrink");
    if (!wrapper) {
      wrapper = document.createElement("div");
      wrapper.className = "course-shrink";
      Array.prototype.slice.call(section.childNodes).forEach(function (node) {
        if (node.tagName !== "ASIDE") wrapper.appendChild(node);
      });
      section.insertBefore(wrapper, section.firstChild);
    }
    return wrapper;
  }

  function unshrink(section) {
    var wrapper = section.querySelector(":scope > .course-shrink");
    if (!wrapper) return;
    while (wrapper.firstChild) section.insertBefore(wrapper.firstChild, wrapper);
    section.removeChild(wrapper);
  }

  // Shrink the slide's content to fit, but not below `least`; true when it fits.
  function shrink(section, height, least) {
    var style = window.getComputedStyle(section);
    var padding = parseFloat(style.paddingTop) + parseFloat(style.paddingBottom);
    var wrapper = shrinkWrapper(section);
    var zoom = Math.max(least, Math.floor((height - padding) / (section.scrollHeight - padding) * 100) / 100);
    wrapper.style.zoom = zoom;
    while (section.scrollHeight > height && zoom > least) {   // text reflows a little differently
      zoom = Math.max(least, Math.round((zoom - 0.01) * 100) / 100);
      wrapper.style.zoom = zoom;
    }
    return section.scrollHeight <= height;
  }

  // 3. One cell too tall on its own: shrink it, then let the slide scroll.
  function shrinkOrScroll(section, height) {
    if (section.scrollHeight <= height || section.classList.contains("course-scroll")) return;
    if (!shrink(section, height, MIN_ZOOM)) {
      section.classList.add("course-scroll");
      section.style.height = height + "px";
    }
  }

  // A slide without a heading whose split would leave its first cell, the caption, alone.
  function captionAlone(section, height) {
    var all = parts(section);
    return !titleOf(section) && all.length > 1 &&
      bottomOf(all[1], section) > bottomLimit(section, height);
  }

  function fitSlide(section, height) {
    var queue = [section];
    while (queue.length) {
      var slide = queue.shift();
      laidOut(slide, function () {
        fitWidths(slide);
        if (slide.scrollHeight <= height) return;
        var least = captionAlone(slide, height) ? CAPTION_SHRINK : MIN_SHRINK;
        if (slide.scrollHeight * least <= height) {
          if (shrink(slide, height, least)) return;
          unshrink(slide);
        }
        var rest = split(slide, height);
        if (rest) {
          queue.unshift(slide, rest);   // the first part may still be a little too tall
        } else {
          shrinkOrScroll(slide, height);
        }
      });
    }
  }

  // Widget views not drawn yet (the widgets manager draws each into a div placed before its
  // <script>, after the page has loaded).
  function widgetsPending(slides) {
    var views = slides.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]');
    return Array.prototype.some.call(views, function (view) {
      var drawn = view.previousElementSibling;
      return !(drawn && drawn.classList.contains("widget-subarea") && drawn.children.length);
    });
  }

  // Call done once widgets, MathJax and images have stopped changing the slides.
  function settled(slides, done) {
    var start = Date.now();
    var last = Date.now();
    var observer = new MutationObserver(function () { last = Date.now(); });
    observer.observe(slides, {childList: true, subtree: true, attributes: true, characterData: true});
    (function check() {
      var now = Date.now();
      var quiet = now - last >= SETTLE_MS && document.readyState === "complete" && !widgetsPending(slides);
      if (quiet || now - start > MAX_WAIT_MS) {
        observer.disconnect();
        done();
      } else {
        setTimeout(check, 100);
      }
    })();
  }

  function followFragments(Reveal) {
    Reveal.on("fragmentshown", function (event) {
      var section = Reveal.getCurrentSlide();
      if (!section || !section.classList.contains("course-scroll")) return;
      var scale = Reveal.getScale() || 1;
      var below = (event.fragment.getBoundingClientRect().bottom - section.getBoundingClientRect().bottom) / scale;
      if (below > 0) section.scrollTop += below + 20;
    });
  }

  // A slide that grew after the start (a widget rendered late): shrink or scroll it when shown.
  function refitWhenShown(Reveal, height) {
    Reveal.on("slidechanged", function (event) {
      var section = event.currentSlide;
      var slides = Reveal.getSlidesElement();
      var zoom = slides.style.zoom;
      slides.style.zoom = "";   // measure at the canvas scale
      fitWidths(section);
      shrinkOrScroll(section, height);
      slides.style.zoom = zoom;
      Reveal.layout();
    });
  }

  window.courseSlides = {
    start: function (Reveal, options) {
      var reveal = document.querySelector(".reveal");
      var slides = reveal.querySelector(".slides");
      settled(slides, function () {
        // reveal.js sets the canvas size when it starts; the slides need it now.
        slides.style.width = options.width + "px";
        slides.style.height = options.height + "px";
        leafSlides(slides).forEach(function (section) { fitSlide(section, options.height); });
        slides.style.width = "";
        slides.style.height = "";
        document.documentElement.dataset.slidesFitted = String(slides.querySelectorAll(".course-continued").length);
        Reveal.initialize(options);
        followFragments(Reveal);
        refitWhenShown(Reveal, options.height);
        // nbconvert's own decks do this: math on a slide is rendered again when it is shown.
        Reveal.on("slidechanged", function () {
          if (window.MathJax && MathJax.Hub && MathJax.Hub.getAllJax(Reveal.getCurrentSlide()).length) {
            MathJax.Hub.Rerender(Reveal.getCurrentSlide());
          }
        });
      });
    }
  };
})();
