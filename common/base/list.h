/*
 * list — an intrusive doubly linked list: a node lives inside the object it
 * links, and a list is a sentinel node, so linking allocates nothing.
 * container_of() turns a node back into its object.
 */
#ifndef ZSHARD_COMMON_LIST_H
#define ZSHARD_COMMON_LIST_H

#include <stddef.h>

#define container_of(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

typedef struct list_node {
  struct list_node *prev, *next;
} list_node;

/* An empty list (or an unlinked node that list_remove may be called on). */
static inline void list_init(list_node *l) {
  l->prev = l->next = l;
}

static inline int list_empty(const list_node *l) {
  return l->next == l;
}

/* Appends n at the tail of `list`. */
static inline void list_push(list_node *list, list_node *n) {
  n->prev = list->prev;
  n->next = list;
  list->prev->next = n;
  list->prev = n;
}

/* Unlinks n; a node that is not linked (next == NULL) is left alone, so a
 * remove after a remove is harmless. */
static inline void list_remove(list_node *n) {
  if (!n->next)
    return;
  n->prev->next = n->next;
  n->next->prev = n->prev;
  n->prev = n->next = NULL;
}

/* Unlinks the first node of `list` and returns it; NULL when it is empty. */
static inline list_node *list_pop(list_node *list) {
  list_node *n = list->next;
  if (n == list)
    return NULL;
  list_remove(n);
  return n;
}

#endif
