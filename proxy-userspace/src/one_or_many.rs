//! A list that nearly always holds one item (a service's one port, its one EndpointSlice, a
//! service port's one frontend or cluster IP). With tens of thousands of services, a boxed list
//! for each is an allocation each, with malloc's overhead: the one item is held in place instead.
use std::{fmt, ops::Deref};

/// Read (and compared) as a slice. Two variants, so that it is no larger than the item where
/// the item leaves room for a boxed list's niche (a name does); none is an empty list, which
/// allocates nothing.
#[derive(Clone)]
pub enum OneOrMany<T> {
    One(T),
    Many(Box<[T]>),
}

impl<T: PartialEq> PartialEq for OneOrMany<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Eq> Eq for OneOrMany<T> {}

impl<T: fmt::Debug> fmt::Debug for OneOrMany<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (**self).fmt(f)
    }
}

impl<T> Default for OneOrMany<T> {
    fn default() -> Self {
        OneOrMany::Many(Box::default())
    }
}

impl<T> Deref for OneOrMany<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            OneOrMany::One(item) => std::slice::from_ref(item),
            OneOrMany::Many(items) => items,
        }
    }
}

impl<T> From<Vec<T>> for OneOrMany<T> {
    fn from(items: Vec<T>) -> Self {
        match <[T; 1]>::try_from(items) {
            Ok([item]) => OneOrMany::One(item),
            Err(items) => OneOrMany::Many(items.into()),
        }
    }
}

impl<T, const N: usize> From<[T; N]> for OneOrMany<T> {
    fn from(items: [T; N]) -> Self {
        Vec::from(items).into()
    }
}

impl<T> OneOrMany<T> {
    pub fn into_vec(self) -> Vec<T> {
        match self {
            OneOrMany::One(item) => vec![item],
            OneOrMany::Many(items) => items.into_vec(),
        }
    }
}

impl<T: Ord + Clone> OneOrMany<T> {
    /// Adds `item` to a sorted list if it is not there.
    pub fn insert_sorted(&mut self, item: &T) {
        if let Err(at) = self.binary_search(item) {
            let mut items = std::mem::take(self).into_vec();
            items.insert(at, item.clone());
            *self = items.into();
        }
    }

    /// Removes `item` from a sorted list.
    pub fn remove_sorted(&mut self, item: &T) {
        if let Ok(at) = self.binary_search(item) {
            let mut items = std::mem::take(self).into_vec();
            items.remove(at);
            *self = items.into();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::model::NamespacedName;

    #[test]
    fn one_item_is_held_in_place_and_a_sorted_list_stays_sorted() {
        let mut names = OneOrMany::default();
        assert!(names.is_empty());
        names.insert_sorted(&"web-b");
        assert!(matches!(names, OneOrMany::One("web-b")));
        for name in ["web-a", "web-b", "web-c"] {
            names.insert_sorted(&name);
        }
        assert_eq!(&*names, ["web-a", "web-b", "web-c"]);
        names.remove_sorted(&"web-b");
        names.remove_sorted(&"web-x");
        assert_eq!(&*names, ["web-a", "web-c"]);
        names.remove_sorted(&"web-a");
        assert!(matches!(names, OneOrMany::One("web-c")));
        names.remove_sorted(&"web-c");
        assert!(names.is_empty());
        assert_eq!(OneOrMany::from(vec![1, 2]).into_vec(), [1, 2]);
        assert_eq!(OneOrMany::from(vec![1]).into_vec(), [1]);
        assert_eq!(OneOrMany::One(1), OneOrMany::Many(Box::new([1])));
    }

    #[test]
    fn it_is_no_larger_than_the_item_it_holds() {
        assert_eq!(
            size_of::<OneOrMany<NamespacedName>>(),
            size_of::<NamespacedName>()
        );
        // A pair of pointers (a service port's name and port) leaves no such room: one word more.
        type Port = (Arc<u8>, Arc<u8>);
        assert_eq!(size_of::<Option<OneOrMany<Port>>>(), 3 * size_of::<usize>());
    }
}
